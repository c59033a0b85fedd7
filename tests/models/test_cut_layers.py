"""``jaxopd.models.weights.cut_layers``: a student cut from its teacher's pretrained weights. Keeping every layer
gives the teacher's logits exactly; a cut equals transformers' own model with those decoder layers alone (an
independent reference: the torch model with its ``layers`` list sliced); the cut saves to a folder transformers
loads to the same logits; bad layer lists are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_hf_qwen3
from jaxopd.models.weights import cut_layers, load_model, save_model

PROMPT = [3, 17, 99, 250, 7, 41, 300, 12]


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_three_layers")
    torch_model = make_hf_qwen3(folder, tied=False, seed=3, num_hidden_layers=3)
    return folder, torch_model


def ours(model) -> np.ndarray:
    return np.asarray(model(np.asarray([PROMPT], np.int32)))[0]


def torch_with_layers(torch_model, keep) -> np.ndarray:
    full = torch_model.model.layers
    try:
        torch_model.model.layers = torch.nn.ModuleList([full[i] for i in keep])
        torch_model.config.num_hidden_layers = len(keep)
        with torch.no_grad():
            return torch_model(torch.tensor([PROMPT]), use_cache=False).logits[0].float().numpy()
    finally:
        torch_model.model.layers = full
        torch_model.config.num_hidden_layers = len(full)


def test_keeping_every_layer_is_the_same_model(three_layers):
    folder, _ = three_layers
    teacher = load_model(folder, dtype="float32")
    student = cut_layers(teacher, [0, 1, 2])
    assert student.config == teacher.config
    np.testing.assert_array_equal(ours(student), ours(teacher))


@pytest.mark.parametrize("keep", [[0, 2], [1], [0, 1]])
def test_a_cut_is_transformers_model_with_those_layers(three_layers, keep):
    folder, torch_model = three_layers
    student = cut_layers(load_model(folder, dtype="float32"), keep)
    assert student.config.num_layers == len(keep)
    reference = torch_with_layers(torch_model, keep)
    np.testing.assert_allclose(ours(student), reference, atol=1e-4, rtol=0)
    full = torch_with_layers(torch_model, [0, 1, 2])
    assert np.abs(reference - full).max() > 1e-2          # the cut changed the logits: the check has teeth


def test_the_cut_saves_to_a_folder_transformers_loads(three_layers, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, torch_model = three_layers
    student = cut_layers(load_model(folder, dtype="float32"), [0, 2])
    save_model(student, tmp_path / "student")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "student", torch_dtype=torch.float32).eval()
    assert loaded.config.num_hidden_layers == 2
    with torch.no_grad():
        theirs = loaded(torch.tensor([PROMPT]), use_cache=False).logits[0].float().numpy()
    np.testing.assert_allclose(theirs, torch_with_layers(torch_model, [0, 2]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours(load_model(tmp_path / "student", dtype="float32")), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("keep, needle", [([], "at least one layer"), ([0, 3], r"lie in \[0, 3\)"),
                                          ([2, 0], "increasing"), ([1, 1], "increasing"), ([-1], r"lie in")])
def test_bad_layer_lists_are_refused(three_layers, keep, needle):
    with pytest.raises(ValueError, match=needle):
        cut_layers(load_model(three_layers[0], dtype="float32"), keep)
