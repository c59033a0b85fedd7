"""ALFWorld environment transitions per second, Vanilla against ActFirst-OPD, side by side in one run.

The two rollout strategies that training runs (``jaxopd.rollout.strategies``: ``vanilla``, think-then-act under
the App. B.3 thinking budget; ``actfirst``, reference-guided inverse-dynamics fast actions with the next-action
fallback and asynchronous full responses) play the same ``--episodes`` generated ALFWorld train games
(``jaxopd_envs.alfworld_gen`` on the real TextWorld engine, references from ``jaxopd_envs.references``) through one
``jaxopd_envs.pool.EnvPool`` (its default backend for ALFWorld) and one engine (same model, engine config and b_max).
Repeats alternate the order (Vanilla first in even repeats) so machine noise hits both; each repeat plays every
episode to its end (the environment, ``--max-turns``, or the strategy) with all its requests finished. Reported:
transitions (executed environment steps, resets excluded) per second of the whole rollout, the median over
repeats, and the ActFirst / Vanilla ratio; also per second up to the last transition (the window in which the
environment advances: ActFirst's trailing full responses excluded).

The paper (ActFirst-OPD App. C.5, Qwen3-1.7B on 8 A100s, 16 tasks per batch, four engines with four runners
each) reports 3.65 → 5.68 env. steps/s (1.56x). By default the model is the random ``tiny`` Qwen3 (its
vocabulary cut to the tokenizer's 151,669 ids, so that every sampled token decodes): random weights produce
almost no valid action, so episodes rarely end before the turn limit, ActFirst's first inverse-dynamics
proposal fails its check and next-action prediction takes over, and ALFWorld answers invalid actions without
running its engine. The figures measure the rollout machinery (engine, strategies, pool), not an agent.

    python bench/env_throughput.py --out results/bench/env_throughput.json
"""
from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from bench.common import write_result  # noqa: E402
from jaxopd import cli  # noqa: E402
from jaxopd.machine import machine_info  # noqa: E402

PAPER = {"vanilla_steps_per_s": 3.65, "actfirst_steps_per_s": 5.68, "ratio": 1.56,
         "setup": "Qwen3-1.7B on ALFWorld, 8 A100s, 16 tasks per rollout batch, four rollout engines with four "
                  "runners each (ActFirst-OPD App. C.5)"}
STRATEGY_NAMES = ("vanilla", "actfirst")


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.env_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="architecture preset of the random model (default tiny)")
    p.add_argument("--weights", default=None, help="a Hugging Face model folder (default: random weights)")
    p.add_argument("--episodes", type=int, default=8, help="concurrent episodes (distinct games) per rollout")
    p.add_argument("--max-turns", type=int, default=6, help="interaction limit per episode")
    p.add_argument("--full-tokens", type=int, default=128,
                   help="thinking budget total of a full response (first stage: all but 32, at least half)")
    p.add_argument("--fast-tokens", type=int, default=16, help="fast-action limit (the paper: 512)")
    p.add_argument("--b-max", type=int, default=None, help="engine concurrency cap (default: 2 x episodes)")
    p.add_argument("--repeats", type=int, default=2, help="timed rollouts per strategy, order alternated")
    p.add_argument("--num-games", type=int, default=16, help="generated train games (>= episodes)")
    p.add_argument("--games-root", default=None, help="an ALFWorld tree to use instead of generated games")
    p.add_argument("--references-dir", default=None,
                   help="reference cache (default: <games root>/../references-<games root name>)")
    p.add_argument("--max-prompt-tokens", type=int, default=1536, help="prompt budget (App. B.2; the paper: 10,240)")
    p.add_argument("--seed", type=int, default=42, help="base of the requests' sampling seeds")
    p.add_argument("--out", default="results/bench/env_throughput.json")
    args = p.parse_args(argv)
    for name in ("episodes", "max_turns", "full_tokens", "fast_tokens", "repeats", "num_games", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.full_tokens < 4:
        p.error("--full-tokens must be >= 4")
    if args.b_max is None:
        args.b_max = 2 * args.episodes
    if args.num_games < args.episodes:
        p.error("--num-games must be >= --episodes")
    return args


def check_args(args) -> None:
    """The input checks, before any game is generated or model built (``jaxopd.cli.UsageError``); also
    ``bench.rollout_quality``'s, which adds its teacher's."""
    if args.weights:
        cli.check_checkpoint_folder("--weights", args.weights)
    else:
        cli.check_model_preset("--model", args.model)
    if args.games_root:
        cli.check_input_folder("--games-root", args.games_root)
    if args.references_dir:
        cli.check_out_dir("--references-dir", args.references_dir)
    cli.check_out_file("--out", args.out)


# ------------------------------------------------------------------------------------------- set-up (shared)
def alfworld_tasks(num_games: int, games_root: str | None, references_dir: str | None, *, count: int):
    """(env factory, the first ``count`` train tasks, their references, the games' description)."""
    from jaxopd_envs.alfworld import AlfWorldEnv
    from jaxopd_envs.references import build_references

    if games_root is None:
        from jaxopd_envs import alfworld_gen
        root = alfworld_gen.ensure_games(None, seed=0, counts={"train": num_games, "valid_seen": 0,
                                                               "valid_unseen": 0}, progress=False)
    else:
        root = Path(games_root)
    factory = functools.partial(AlfWorldEnv, root)
    with factory() as probe:
        tasks = list(probe.tasks("train"))[:count]
        source = probe.source
    cache = Path(references_dir) if references_dir else Path(root).parent / f"references-{Path(root).name}"
    references = build_references(factory, tasks, cache)
    games = ("ALFWorld-format train games generated by jaxopd_envs.alfworld_gen on the real TextWorld engine (not the "
             "ALFWorld benchmark split)" if source == "generated" else f"ALFWorld train games ({source})")
    return factory, tasks, references, {"games": games, "root": str(root), "num_tasks": len(tasks),
                                        "reference_steps": [len(references[t.task_id]) for t in tasks]}


def build_model(model_name: str, weights: str | None, *, seed: int = 0):
    """(model, tokenizer, description). Random weights use the tokenizer's vocabulary size (no padding rows)."""
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig, count_params
    from jaxopd.models.folders import load_folder_tokenizer

    tokenizer = load_folder_tokenizer(weights)         # random weights: the offline Qwen3 tokenizer
    if weights:
        from jaxopd.models.folders import load_folder      # a Hugging Face folder or an adapter folder over one
        model, name = load_folder(weights), Path(weights).name
    else:
        config = dataclasses.replace(ModelConfig.preset(model_name), vocab_size=tokenizer.vocab_size)
        model, name = CausalLM(config, rngs=nnx.Rngs(seed)), model_name
    _, state = nnx.split(model)
    info = {"name": name, "weights": weights, "random_weights": not weights, "num_params": count_params(state),
            "dtype": model.config.dtype, "vocab_size": model.config.vocab_size}
    return model, tokenizer, info


def engine_config(b_max: int, max_prompt_tokens: int, max_new_tokens: int):
    """Pages for ``b_max`` sequences of the longest prompt plus response (no preemption)."""
    from jaxopd.sampler import EngineConfig

    page_size = 64
    pages_per_seq = -(-(max_prompt_tokens + max_new_tokens + 1) // page_size)
    return EngineConfig(max_slots=b_max, page_size=page_size, num_pages=b_max * pages_per_seq + 1,
                        max_seq_len=pages_per_seq * page_size, prefill_chunk=512, max_prefill_tokens=512,
                        max_prefill_rows=1, policy="fifo")


def thinking_budget(full_tokens: int):
    from jaxopd.rollout.thinking import ThinkingBudget

    first = max(full_tokens // 2, full_tokens - 32)     # 128: 96 / 128 / <= 32 (the training 384 / 512 / 128, scaled)
    return ThinkingBudget(first_stage_tokens=first, total_tokens=full_tokens,
                          second_stage_max_tokens=max(1, full_tokens - first))


class TimedPool:
    """An ``EnvPool`` seen by a strategy, recording when each step returned (``perf_counter``)."""

    def __init__(self, pool):
        self.pool = pool
        self.num_slots = pool.num_slots
        self.step_times: list[float] = []
        self._lock = threading.Lock()

    def submit_reset(self, slot, task):
        return self.pool.submit_reset(slot, task)

    def submit_step(self, slot, action):
        future = self.pool.submit_step(slot, action)
        future.add_done_callback(self._stamp)
        return future

    def trajectory(self, slot):
        return self.pool.trajectory(slot)

    def _stamp(self, _future) -> None:
        with self._lock:
            self.step_times.append(time.perf_counter())


def warm_env_pool(env_pool, tasks) -> None:
    """Build every environment and reset every task once in every worker (untimed): ALFWorld caches its PDDL
    translations per process, and a strategy's episodes may land on any slot."""
    env_pool.warm_up()
    workers = env_pool.max_workers if env_pool.backend == "process" else 1
    for slot in range(min(workers, env_pool.num_slots)):     # slot i runs in worker i (round robin)
        for task in tasks:
            env_pool.reset(slot, task)


# ------------------------------------------------------------------------------------------------ the run
def make_strategy(name: str, engine, pool, tokenizer, args):
    from jaxopd.rollout.strategies import ActFirstStrategy, RolloutConfig, VanillaStrategy, actfirst_config

    common = dict(max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
                  thinking_budget=thinking_budget(args.full_tokens), seed=args.seed)
    if name == "vanilla":
        return VanillaStrategy(engine, pool, tokenizer, RolloutConfig(**common))
    return ActFirstStrategy(engine, pool, tokenizer, actfirst_config(fast_action_max_tokens=args.fast_tokens,
                                                                     **common))


def timed_rollout(strategy, tasks, references) -> dict[str, Any]:
    """Play every task once (one episode per pool slot); transitions per second and what the episodes did."""
    from jaxopd.rollout.trajectory import rollout_quality

    pool = strategy.pool
    pool.step_times.clear()
    start = time.perf_counter()
    trajectories = strategy.collect(tasks, references)
    wall = time.perf_counter() - start
    steps = sum(t.num_turns for t in trajectories)
    last_step = max(pool.step_times) - start if pool.step_times else wall
    turns = [turn for t in trajectories for turn in t.turns]
    quality = rollout_quality(trajectories)
    sources: dict[str, int] = {}
    for turn in turns:
        sources[turn.action_source] = sources.get(turn.action_source, 0) + 1
    return {"wall_s": wall, "steps": steps, "steps_per_s": steps / wall,
            "last_transition_s": last_step, "steps_per_s_to_last_transition": steps / last_step,
            "requests": {"full": sum(len(turn.responses) for turn in turns),
                         "fast": sum(len(turn.action_responses) for turn in turns)},
            "valid_action_rate": quality_valid_rate(trajectories), "won": sum(t.won for t in trajectories),
            "mean_turns": quality.mean_turns, "action_sources": sources,
            "end_reasons": sorted({t.end_reason for t in trajectories}),
            "samples": sum(len(t.responses()) for t in trajectories)}


def quality_valid_rate(trajectories) -> float:
    """Share of executed actions that were valid in their state (App. C.5 validity), over all turns."""
    steps = [step for t in trajectories for step in t.quality_record().steps]
    return sum(step.valid for step in steps) / len(steps) if steps else 0.0


def markdown(result: dict) -> str:
    s = result["summary"]
    cfg = result["config"]
    model = result["model"]
    weights = "random weights" if model["random_weights"] else f"weights {model['weights']}"
    lines = [f"ALFWorld environment transitions per second, Vanilla vs ActFirst-OPD: {cfg['episodes']} concurrent "
             f"episodes of generated train games (max {cfg['max_turns']} turns), model `{model['name']}` "
             f"({weights}), b_max {cfg['b_max']}, full responses {cfg['full_tokens']} tokens (thinking budget), "
             f"fast actions <= {cfg['fast_tokens']} tokens, EnvPool backend `{result['pool_backend']}`; "
             f"{result['machine']['cpu_count']} CPUs ({result['machine']['backend']}); median of "
             f"{cfg['repeats']} alternated repeats.", "",
             "| strategy | env steps/s (whole rollout) | env steps/s (to last transition) | rollout s | steps | "
             "valid actions | mean turns | full / fast requests |", "|---|---|---|---|---|---|---|---|"]
    for name in STRATEGY_NAMES:
        r = s[name]
        lines.append(f"| {name} | {r['steps_per_s']:.2f} | {r['steps_per_s_to_last_transition']:.2f} | "
                     f"{r['wall_s']:.1f} | {r['steps']} | {100 * r['valid_action_rate']:.0f}% | "
                     f"{r['mean_turns']:.1f} | "
                     f"{r['requests']['full']} / {r['requests']['fast']} |")
    lines += ["", f"ActFirst / Vanilla: **{s['ratio']:.2f}x** (whole rollout), {s['ratio_to_last_transition']:.2f}x "
                  f"(to the last transition). Paper: {PAPER['vanilla_steps_per_s']} → {PAPER['actfirst_steps_per_s']} "
                  f"steps/s ({PAPER['ratio']}x), {PAPER['setup']}.", "", f"Note: {result['note']}", "",
              f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None):
    args = parse_args(argv)
    check_args(args)
    from jaxopd_envs.pool import EnvPool
    from jaxopd.sampler import Engine

    t0 = time.perf_counter()
    factory, tasks, references, games = alfworld_tasks(args.num_games, args.games_root, args.references_dir,
                                                       count=args.episodes)
    setup = {"games_and_references_s": time.perf_counter() - t0}
    t = time.perf_counter()
    model, tokenizer, model_info = build_model(args.model, args.weights)
    config = engine_config(args.b_max, args.max_prompt_tokens, args.full_tokens)
    engine = Engine(model, config, tokenizer=tokenizer)
    engine.start()
    compiled = engine.warmup()
    setup["model_and_warmup_s"] = time.perf_counter() - t
    print(f"{len(tasks)} tasks ({games['games']}); model {model_info['name']} "
          f"({model_info['num_params'] / 1e6:.1f}M parameters, {'random' if not args.weights else 'loaded'} weights); "
          f"engine warm-up {compiled} shapes; {os.cpu_count()} CPUs", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in STRATEGY_NAMES}
    try:
        with EnvPool(factory, num_slots=len(tasks)) as env_pool:
            t = time.perf_counter()
            warm_env_pool(env_pool, tasks)
            setup["env_pool_s"] = time.perf_counter() - t
            pool = TimedPool(env_pool)
            strategies = {name: make_strategy(name, engine, pool, tokenizer, args) for name in STRATEGY_NAMES}
            for k in range(args.repeats):
                order = STRATEGY_NAMES if k % 2 == 0 else STRATEGY_NAMES[::-1]
                for name in order:
                    run = timed_rollout(strategies[name], tasks, references)
                    run["repeat"], run["order"] = k, list(order)
                    runs[name].append(run)
                    print(f"repeat {k} {name:>8}: {run['steps_per_s']:.2f} steps/s ({run['steps']} steps in "
                          f"{run['wall_s']:.1f} s; to last transition {run['steps_per_s_to_last_transition']:.2f}); "
                          f"valid actions {100 * run['valid_action_rate']:.0f}%", flush=True)
            backend = env_pool.backend
            recoveries = env_pool.recoveries
        assert engine.wait_idle(timeout=600) and engine.scheduler.allocator.num_used == 0, "pages leaked"
    finally:
        engine.stop()

    def median_run(name: str) -> dict:
        rs = runs[name]
        out = {key: statistics.median(r[key] for r in rs)
               for key in ("steps_per_s", "steps_per_s_to_last_transition", "wall_s", "steps", "valid_action_rate",
                           "mean_turns")}
        out["requests"] = {kind: statistics.median(r["requests"][kind] for r in rs) for kind in ("full", "fast")}
        return out

    summary = {name: median_run(name) for name in STRATEGY_NAMES}
    summary["ratio"] = summary["actfirst"]["steps_per_s"] / summary["vanilla"]["steps_per_s"]
    summary["ratio_to_last_transition"] = (summary["actfirst"]["steps_per_s_to_last_transition"]
                                           / summary["vanilla"]["steps_per_s_to_last_transition"])
    summary["ratio_per_repeat"] = [a["steps_per_s"] / v["steps_per_s"]
                                   for v, a in zip(runs["vanilla"], runs["actfirst"])]
    note = ("random weights: almost every action is invalid or empty (see the valid-action rate), so episodes run to "
            "the turn limit, ActFirst's first inverse-dynamics proposal fails and its transition check disables "
            "guidance (next-action prediction afterwards), and ALFWorld answers invalid actions without running its "
            "engine; the figures measure the rollout machinery, not an agent" if model_info["random_weights"] else
            "trained weights")
    result = {
        "benchmark": "ALFWorld environment transitions per second, Vanilla vs ActFirst-OPD",
        "command": " ".join(["python", "bench/env_throughput.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "machine": machine_info(), "model": model_info, "engine": dataclasses.asdict(config),
        "config": {k: getattr(args, k) for k in ("episodes", "max_turns", "full_tokens", "fast_tokens", "b_max",
                                                 "repeats", "num_games", "max_prompt_tokens", "seed")},
        "thinking_budget": dataclasses.asdict(thinking_budget(args.full_tokens)),
        "games": games, "pool_backend": backend, "pool_recoveries": recoveries, "setup_s": setup,
        "runs": runs, "summary": summary, "paper": PAPER, "note": note,
        "load_average_end": os.getloadavg(),
    }
    write_result(result, markdown(result), args.out)
    return result


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
