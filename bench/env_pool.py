"""ALFWorld environment steps per second through ``EnvPool``: threads (one engine lock) vs worker processes.

A rollout is ``--episodes`` ALFWorld episodes played concurrently, each resetting its game and then
executing that game's stored walkthrough (scripted actions: no model in the loop), every episode in
its own asyncio task through ``areset``/``astep`` as a rollout does. For every worker count 1, 2, 4, ...
up to ``--max-workers`` the same rollout runs on the "thread" backend (that many host threads; every
ALFWorld call holds TextWorld's process-wide engine lock) and on the "process" backend (that many
worker processes, slots spread round-robin). At each worker count both pools are open at once: each
builds its environments and plays one untimed rollout (game loading and PDDL translation are cached per
process), then the two play ``--repeats`` timed rollouts in alternation, so both see the same machine
state; the median is reported, with the CPU time a rollout cost (this process and its workers).
Unloaded latencies (one slot, one worker, sequential calls) are measured for both backends. Prints a
markdown table, writes JSON to ``--out`` and the table beside it.

Games are generated ALFWorld-format tasks on the real TextWorld engine (``jaxopd_envs.alfworld_gen``, cached),
not the ALFWorld benchmark splits, unless ``--games-root`` points at another tree.

    python bench/env_pool.py --max-workers 2 --out results/bench/env_pool.json
"""
from __future__ import annotations

import asyncio
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from bench.common import write_result  # noqa: E402
from jaxopd import cli  # noqa: E402
from jaxopd.machine import machine_info  # noqa: E402

from jaxopd_envs.alfworld import AlfWorldEnv  # noqa: E402
from jaxopd_envs.pool import EnvPool  # noqa: E402


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.env_pool", description=__doc__.splitlines()[0])
    p.add_argument("--max-workers", type=int, default=os.cpu_count() or 1,
                   help="largest number of threads / worker processes (default: the CPU count)")
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="worker counts to run (default: 1, 2, 4, ... up to --max-workers, and --max-workers)")
    p.add_argument("--episodes", type=int, default=16, help="concurrent episodes in a rollout")
    p.add_argument("--repeats", type=int, default=2, help="timed rollouts per configuration")
    p.add_argument("--num-games", type=int, default=16, help="generated train games (distinct tasks)")
    p.add_argument("--games-root", default=None, help="an ALFWorld tree to use instead of generated games")
    p.add_argument("--cache-dir", default=None, help="where generated games are cached (default: envs cache)")
    p.add_argument("--latency-calls", type=int, default=3, help="passes over the games for unloaded latency")
    p.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver"))
    p.add_argument("--out", default="results/bench/env_pool.json")
    args = p.parse_args(argv)
    for name in ("max_workers", "episodes", "repeats", "num_games", "latency_calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers is None:
        counts, w = [], 1
        while w < args.max_workers:
            counts.append(w)
            w *= 2
        args.workers = counts + [args.max_workers]
    elif min(args.workers) < 1:
        p.error("--workers must be >= 1")
    return args


def check_args(args) -> None:
    """The input checks, before any game is generated or environment built (``jaxopd.cli.UsageError``)."""
    if args.games_root:
        cli.check_input_folder("--games-root", args.games_root)
    elif args.cache_dir:
        cli.check_out_dir("--cache-dir", args.cache_dir)
    cli.check_out_file("--out", args.out)


def games_root(args) -> Path:
    if args.games_root:
        return Path(args.games_root)
    from jaxopd_envs import alfworld_gen

    return alfworld_gen.ensure_games(args.cache_dir, seed=0, counts={"train": args.num_games, "valid_seen": 0,
                                                                       "valid_unseen": 0}, progress=False)


async def _episode(pool: EnvPool, slot: int, task, actions, calls: list) -> int:
    start = time.perf_counter()
    observation = await pool.areset(slot, task)
    calls.append(("reset", time.perf_counter() - start))
    for action in actions:
        start = time.perf_counter()
        observation = await pool.astep(slot, action)
        calls.append(("step", time.perf_counter() - start))
    if not observation.won:
        raise RuntimeError(f"slot {slot}: the walkthrough of {task.task_id} did not win")
    return len(actions)


def rollout(pool: EnvPool, plan) -> dict:
    """Play every slot's episode concurrently; wall time, steps and caller-side call latencies."""
    calls: list = []

    async def run():
        return await asyncio.gather(*(_episode(pool, slot, task, actions, calls)
                                      for slot, (task, actions) in enumerate(plan)))

    start = time.perf_counter()
    steps = sum(asyncio.run(run()))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "steps": steps, "resets": len(plan),
            "reset_ms_mean": 1e3 * statistics.mean(t for kind, t in calls if kind == "reset"),
            "step_ms_mean": 1e3 * statistics.mean(t for kind, t in calls if kind == "step")}


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far, from /proc (Linux); NaN elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_rollout(pool: EnvPool, plan) -> dict:
    """A rollout plus the CPU time it cost: this process (all its threads) and every worker process."""
    workers = [pid for pid in pool.worker_pids if pid is not None]
    host_before, workers_before = time.process_time(), [_cpu_seconds(pid) for pid in workers]
    result = rollout(pool, plan)
    result["host_cpu_s"] = time.process_time() - host_before
    result["worker_cpu_s"] = sum(_cpu_seconds(pid) - before for pid, before in zip(workers, workers_before))
    return result


def measure_workers(factory, workers: int, plan, args) -> list[dict]:
    """Both backends at ``workers``: both pools open at once, their timed rollouts alternating, so that
    both see the same machine state (this matters on a shared machine)."""
    pools, startup, cold = {}, {}, {}
    try:
        for backend in ("thread", "process"):
            start = time.perf_counter()
            pools[backend] = EnvPool(factory, len(plan), backend=backend, max_workers=workers,
                                     start_method=args.start_method, call_timeout_s=600, build_timeout_s=600)
            pools[backend].warm_up()
            startup[backend] = time.perf_counter() - start
            cold[backend] = rollout(pools[backend], plan)       # loads every game, fills translation caches
        runs: dict[str, list[dict]] = {"thread": [], "process": []}
        for repeat in range(args.repeats):
            order = ("thread", "process") if repeat % 2 == 0 else ("process", "thread")
            for backend in order:
                runs[backend].append(timed_rollout(pools[backend], plan))
        recoveries = {backend: pool.recoveries for backend, pool in pools.items()}
    finally:
        for pool in pools.values():
            pool.close()
    rows = []
    for backend in ("thread", "process"):
        timed = runs[backend]
        wall = statistics.median(r["wall_s"] for r in timed)
        steps = timed[0]["steps"]
        cpu = statistics.median(r["host_cpu_s"] + r["worker_cpu_s"] for r in timed)
        rows.append({"backend": backend, "workers": workers, "episodes": len(plan), "steps": steps,
                     "rollout_s": wall, "steps_per_s": steps / wall, "env_calls_per_s": (steps + len(plan)) / wall,
                     "reset_ms_mean_loaded": statistics.median(r["reset_ms_mean"] for r in timed),
                     "step_ms_mean_loaded": statistics.median(r["step_ms_mean"] for r in timed),
                     "cpu_s_per_rollout": cpu, "cores_busy": cpu / wall,
                     "host_cpu_s_per_rollout": statistics.median(r["host_cpu_s"] for r in timed),
                     "startup_s": startup[backend], "first_rollout_s": cold[backend]["wall_s"],
                     "rollout_times_s": [r["wall_s"] for r in timed], "recoveries": recoveries[backend]})
    return rows


def measure_latency(factory, backend: str, tasks, plans, args) -> dict:
    """One slot, one worker, one call at a time: what a single reset and step cost on each backend."""
    resets, steps = [], []
    with EnvPool(factory, 1, backend=backend, max_workers=1, start_method=args.start_method,
                 call_timeout_s=600, build_timeout_s=600) as pool:
        pool.warm_up()
        for task in tasks:                          # untimed: load and translate every game once
            pool.reset(0, task)
        for _ in range(args.latency_calls):
            for task in tasks:
                start = time.perf_counter()
                pool.reset(0, task)
                resets.append(time.perf_counter() - start)
                for action in plans[task.task_id]:
                    start = time.perf_counter()
                    pool.step(0, action)
                    steps.append(time.perf_counter() - start)
    return {"backend": backend, "reset_ms_median": 1e3 * statistics.median(resets),
            "step_ms_median": 1e3 * statistics.median(steps), "resets": len(resets), "steps": len(steps)}


def markdown(result: dict) -> str:
    rows = result["rows"]
    base = next(r for r in rows if r["backend"] == "thread" and r["workers"] == 1)["steps_per_s"]
    lines = [f"ALFWorld through EnvPool, {result['episodes']} concurrent episodes of scripted walkthrough actions "
             f"({result['steps_per_rollout']} steps + {result['episodes']} resets per rollout), "
             f"{result['machine']['cpu_count']} CPUs (1-min load average {result['load_average_start'][0]:.1f} "
             f"at the start, "
             f"{result['load_average_end'][0]:.1f} at the end); median of {result['repeats']} timed rollouts after a "
             f"warm one.",
             "", "| backend | workers | steps/s | rollout s | vs 1 thread | mean step ms (loaded) "
                 "| CPU s per rollout | cores busy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['workers']} | {r['steps_per_s']:.2f} | {r['rollout_s']:.2f} | "
                     f"{r['steps_per_s'] / base:.2f}x | {r['step_ms_mean_loaded']:.0f} | "
                     f"{r['cpu_s_per_rollout']:.1f} | {r['cores_busy']:.2f} |")
    lines += ["", "cores busy = CPU seconds of this process and its workers per second of rollout: below the "
                  "worker count when other jobs hold the cores.",
              "", "| backend | reset ms (median, one slot) | step ms (median, one slot) |", "|---|---|---|"]
    for backend, lat in result["latency"].items():
        lines.append(f"| {backend} | {lat['reset_ms_median']:.0f} | {lat['step_ms_median']:.0f} |")
    gain = result["rollout_gain"]
    lines += ["", f"A rollout of {result['episodes']} ALFWorld episodes: {gain['thread_1_s']:.1f} s with one "
                  f"thread (engine lock), {gain['best_process_s']:.1f} s with {gain['best_process_workers']} worker "
                  f"processes: {gain['speedup']:.2f}x.", "", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    load_start = os.getloadavg()
    root = games_root(args)
    factory = functools.partial(AlfWorldEnv, root)
    with AlfWorldEnv(root) as probe:
        tasks = list(probe.tasks("train"))
        plans = {t.task_id: probe.walkthrough(t) for t in tasks}
        source = probe.source
    plan = [(tasks[i % len(tasks)], plans[tasks[i % len(tasks)].task_id]) for i in range(args.episodes)]
    print(f"{len(tasks)} {source} ALFWorld games under {root}; {args.episodes} episodes, "
          f"{sum(len(a) for _, a in plan)} walkthrough steps per rollout; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    latency = {}
    for backend in ("thread", "process"):
        latency[backend] = measure_latency(factory, backend, tasks[:min(len(tasks), 6)], plans, args)
        print(f"latency {backend:>7}: reset {latency[backend]['reset_ms_median']:.0f} ms, "
              f"step {latency[backend]['step_ms_median']:.0f} ms (median, one slot)", flush=True)
    rows = []
    for workers in args.workers:
        for row in measure_workers(factory, workers, plan, args):
            rows.append(row)
            print(f"{row['backend']:>7} x{workers:<3} {row['steps_per_s']:7.2f} steps/s  "
                  f"rollout {row['rollout_s']:6.2f} s  cpu {row['cpu_s_per_rollout']:5.1f} s  "
                  f"(startup {row['startup_s']:.1f} s, first rollout {row['first_rollout_s']:.1f} s)", flush=True)
    thread_1 = next(r for r in rows if r["backend"] == "thread" and r["workers"] == 1)
    best = min((r for r in rows if r["backend"] == "process"), key=lambda r: r["rollout_s"])
    result = {
        "benchmark": "ALFWorld-format games generated by jaxopd_envs.alfworld_gen on the real TextWorld engine "
                     "(not the ALFWorld benchmark splits)" if source == "generated" else f"ALFWorld ({source})",
        "games": len(tasks), "episodes": args.episodes, "steps_per_rollout": thread_1["steps"],
        "repeats": args.repeats, "start_method": args.start_method, "rows": rows, "latency": latency,
        "rollout_gain": {"thread_1_s": thread_1["rollout_s"], "best_process_s": best["rollout_s"],
                         "best_process_workers": best["workers"], "speedup": thread_1["rollout_s"] / best["rollout_s"]},
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "machine": machine_info(devices=False),
        "command": " ".join(["python", "bench/env_pool.py"] + (sys.argv[1:] if argv is None else list(argv))),
    }
    write_result(result, markdown(result), args.out)
    return result


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
