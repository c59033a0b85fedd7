"""Text environments (ALFWorld, ScienceWorld) behind one interface, stepped in host threads."""
