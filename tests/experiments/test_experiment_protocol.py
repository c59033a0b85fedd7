"""Scheduling of the paired Vanilla / ActFirst protocol, verified on a virtual clock and on recorded events,
plus context sampling and snapshots."""
import collections
import random
from concurrent.futures import Future

import numpy as np
import pytest

from jaxopd_experiments.actfirst_alfworld import idealized
from jaxopd_experiments.actfirst_alfworld.contexts import (
    ALFWORLD_TASK_TYPES,
    ContextSet,
    InitialContext,
    load_context_set,
    proportional_allocation,
    sample_proportionally,
    save_context_set,
    tokenize_contexts,
)
from jaxopd_experiments.actfirst_alfworld.protocol import (
    FixedContextEnv,
    ScheduleViolation,
    TaskContext,
    Workload,
    calibrate_latencies,
    check_schedule,
    context_task,
    make_batches,
    parse_request_id,
    peak_concurrency,
    request_seed,
    run_batch,
    run_paired_point,
    strategy_order,
)
from jaxopd.sampler.simulated import SimulatedEngine
from jaxopd.sampler.types import Result, Timings


def contexts(n, prompt_len=5):
    return [TaskContext(index=i, context_id=f"ctx{i}", task_type="pick_and_place_simple",
                        full_prompt_ids=tuple(range(1, prompt_len + 1)), fast_prompt_ids=tuple(range(2, prompt_len)))
            for i in range(n)]


def check_concurrency_cap(events, b_max):
    """Running = admitted and not finished, replayed in event order, never exceeds b_max; returns the peak."""
    running = peak = 0
    for e in events:
        if e.event == "admit":
            running += 1
        elif e.event == "finish":
            running -= 1
        assert 0 <= running <= b_max, f"{running} requests admitted at once with b_max={b_max}"
        peak = max(peak, running)
    return peak


# ------------------------------------------------------------------------------------------- fake clock
def test_hand_computed_batch_at_b_max_equal_to_n():
    """N=2, T=2, l_fast=1, l_full=4, b_max=2, fifo. Vanilla: 2 turns x 4 = 8.
    ActFirst by hand: t=0 admit f0,F0 (task0) | t=1 f0 done, turn 1 of task0 queued; admit f1(task1 t0)
    | t=2 admit F1 | t=4 F0 done, admit task0 f | t=5 admit task0 F | t=6 F1 done, admit task1 f | t=7 admit
    task1 F | t=9 task0 F done | t=11 task1 F done -> 11."""
    engine = SimulatedEngine({"fast": 1.0, "full": 4.0})
    ctx = contexts(2)
    vanilla = run_batch(engine, "vanilla", ctx, 2, Workload(), b_max=2)
    actfirst = run_batch(engine, "actfirst", ctx, 2, Workload(), b_max=2)
    assert vanilla.completion_time == pytest.approx(8.0)
    assert actfirst.completion_time == pytest.approx(11.0)
    # and with room for everything, Proposition 1: (T-1) l_fast + l_full = 5
    assert run_batch(engine, "actfirst", ctx, 2, Workload(), b_max=8).completion_time == pytest.approx(5.0)


def test_unlimited_concurrency_reproduces_proposition_1():
    engine = SimulatedEngine({"fast": 0.5, "full": 3.0})
    for T in (1, 2, 5, 13):
        v = run_batch(engine, "vanilla", contexts(4), T, Workload(), b_max=256)
        a = run_batch(engine, "actfirst", contexts(4), T, Workload(), b_max=256)
        assert v.completion_time == pytest.approx(idealized.vanilla_completion_time(T, 3.0))
        assert a.completion_time == pytest.approx(idealized.actfirst_completion_time(T, 0.5, 3.0))
        assert v.completion_time / a.completion_time == pytest.approx(idealized.ideal_speedup(T, 0.5, 3.0))


@pytest.mark.parametrize("policy", ["fifo", "fast-first"])
@pytest.mark.parametrize("b_max", [1, 2, 3, 5, 64])
def test_recorded_events_follow_the_protocol_and_the_cap(policy, b_max):
    N, T = 3, 4
    engine = SimulatedEngine({"fast": 1.0, "full": 5.0}, policy=policy)
    vanilla = run_batch(engine, "vanilla", contexts(N), T, Workload(), b_max=b_max, tag="v", check_events=True)
    vanilla_events, engine.events = engine.events, []
    actfirst = run_batch(engine, "actfirst", contexts(N), T, Workload(), b_max=b_max, tag="a", check_events=True)
    actfirst_events = engine.events
    # check_schedule ran inside run_batch; the cap is also re-checked here by a plain replay, and the peak
    # agrees with the one computed from the requests' own timings
    assert check_concurrency_cap(vanilla_events, b_max) == vanilla.schedule.peak_concurrency == min(b_max, N)
    assert check_concurrency_cap(actfirst_events, b_max) == actfirst.schedule.peak_concurrency \
        == actfirst.peak_concurrency
    assert min(b_max, 2 * N) <= actfirst.peak_concurrency <= b_max     # 2N requests are submitted at t = 0
    assert vanilla.schedule.max_full_in_flight_per_task == 1
    # every Vanilla turn starts exactly when the previous full response ends (virtual clock: no gap)
    for task in range(N):
        recs = sorted((r for r in vanilla.records if r.task == task), key=lambda r: r.turn)
        assert [r.submitted_at for r in recs[1:]] == pytest.approx([r.finished_at for r in recs[:-1]])
    # every ActFirst turn starts exactly when the previous fast action ends
    for task in range(N):
        fast = {r.turn: r for r in actfirst.records if r.task == task and r.kind == "fast"}
        for r in actfirst.records:
            if r.task == task and r.turn > 0:
                assert r.submitted_at == pytest.approx(fast[r.turn - 1].finished_at)
    if b_max >= 2 * N * T:
        # full responses overlap each other and later turns: with l_full = 5 > l_fast, a task has all its
        # T full responses in flight at once, and the batch meets Proposition 1
        assert actfirst.schedule.max_full_in_flight_per_task == T
        assert actfirst.completion_time == pytest.approx((T - 1) * 1.0 + 5.0)


def test_the_schedule_checks_catch_violations():
    engine = SimulatedEngine({"fast": 1.0, "full": 5.0})
    run_batch(engine, "actfirst", contexts(2), 3, Workload(), b_max=4, tag="a")
    events = list(engine.events)
    check_schedule(events, "actfirst", tag="a", T=3, num_tasks=2, b_max=4)
    with pytest.raises(ScheduleViolation, match="Vanilla task"):
        check_schedule(events, "vanilla", tag="a", T=3, num_tasks=2, b_max=4)       # ActFirst is not Vanilla
    with pytest.raises(ScheduleViolation, match="b_max=3"):
        check_schedule(events, "actfirst", tag="a", T=3, num_tasks=2, b_max=3)      # the cap of 4 was reached
    with pytest.raises(ScheduleViolation, match="missing"):
        check_schedule(events, "actfirst", tag="a", T=4, num_tasks=2, b_max=4)
    # task 0's turn-1 submissions recorded before its turn-0 fast action finished: the gate check fails
    early = [e for e in events if e.event == "submit" and parse_request_id(e.request_id)[1:3] == (0, 1)]
    with pytest.raises(ScheduleViolation, match="submitted before"):
        check_schedule(early + [e for e in events if e not in early], "actfirst", tag="a", T=3, num_tasks=2, b_max=4)
    # a Vanilla turn submitted while the previous one runs
    engine = SimulatedEngine({"fast": 1.0, "full": 5.0})
    run_batch(engine, "vanilla", contexts(1), 2, Workload(), b_max=4, tag="v")
    ev = list(engine.events)            # submit0 admit0 finish0 submit1 admit1 finish1
    with pytest.raises(ScheduleViolation):
        check_schedule([ev[0], ev[1], ev[3], ev[2], ev[4], ev[5]], "vanilla", tag="v", T=2, num_tasks=1, b_max=4)
    with pytest.raises(ValueError):
        parse_request_id("not/an/id")


def test_completion_times_respect_the_a2_lower_bound_on_random_workloads():
    rng = random.Random(0)
    for _ in range(60):
        N, T = rng.randint(1, 6), rng.randint(1, 8)
        l_fast = rng.uniform(0.1, 2.0)
        l_full = rng.uniform(l_fast, 8.0)
        b_max = rng.randint(1, 3 * N * T)
        policy = rng.choice(["fifo", "fast-first"])
        engine = SimulatedEngine({"fast": l_fast, "full": l_full}, policy=policy)
        a = run_batch(engine, "actfirst", contexts(N), T, Workload(), b_max=b_max)
        v = run_batch(engine, "vanilla", contexts(N), T, Workload(), b_max=b_max)
        lower = idealized.actfirst_completion_lower_bound(N, T, l_fast, l_full, b_max)
        assert a.completion_time >= lower * (1 - 1e-9)
        assert v.completion_time >= T * l_full * (1 - 1e-9)
        if b_max >= N:
            assert v.completion_time == pytest.approx(T * l_full)
            assert v.completion_time / a.completion_time <= \
                idealized.ideal_baseline_speedup_upper_bound(N, T, l_fast, l_full, b_max) * (1 + 1e-9)


def test_slowdown_model_stretches_service_with_the_batch():
    # two requests of 2 s each at slowdown(n) = n (processor sharing): both finish at 4 s
    engine = SimulatedEngine({"fast": 1.0, "full": 2.0}, slowdown=lambda n: float(n))
    run = run_batch(engine, "vanilla", contexts(2), 1, Workload(), b_max=2)
    assert run.completion_time == pytest.approx(4.0)
    assert [r.finished_at for r in run.records] == pytest.approx([4.0, 4.0])


class RecordingEngine(SimulatedEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        return super().submit(request)


def test_paired_point_alternates_order_and_shares_full_response_seeds():
    engine = RecordingEngine({"fast": 1.0, "full": 3.0})
    batches = make_batches(contexts(6), 3, 2)
    point = run_paired_point(engine, batches, T=3, b_max=4, workload=Workload(full_tokens=32), repeats=3,
                             base_seed=7)
    assert [r.order for r in point.repeats] == [strategy_order(0), strategy_order(1), strategy_order(2)]
    assert strategy_order(0) == ("vanilla", "actfirst") and strategy_order(1) == ("actfirst", "vanilla")
    # deterministic engine: every repeat gives the same speedup, std 0
    assert point.speedups == pytest.approx([point.speedups[0]] * 3)
    assert point.speedup_std == pytest.approx(0.0)
    r = point.repeats[0]
    assert r.speedup == pytest.approx(sum(v.completion_time for v in r.vanilla)
                                      / sum(a.completion_time for a in r.actfirst))
    # full responses: identical (prompt, seed, length) multisets under both strategies in every repeat
    fulls = collections.defaultdict(collections.Counter)
    for req in engine.requests:
        rep, strategy = req.request_id.split("/")[3], req.request_id.split("/")[5]
        if req.kind == "full":
            fulls[(rep, strategy)][(tuple(req.prompt_ids), req.params.seed, req.params.max_new_tokens,
                                    req.params.min_new_tokens, req.params.temperature, req.params.top_p,
                                    req.params.top_k)] += 1
    for rep in ("rep0", "rep1", "rep2"):
        assert fulls[(rep, "vanilla")] == fulls[(rep, "actfirst")] == fulls[("rep0", "vanilla")]
    assert all(req.params.min_new_tokens == req.params.max_new_tokens for req in engine.requests)
    assert {req.params.max_new_tokens for req in engine.requests if req.kind == "fast"} == {16}
    assert {req.params.max_new_tokens for req in engine.requests if req.kind == "full"} == {32}



def test_batches_are_played_by_the_rollout_strategies_on_fixed_contexts():
    """run_batch drives VanillaStrategy / ActFirstStrategy over FixedContextEnv: every turn re-sends the context's
    own prompt of its kind, with the strategies' seeds, and the trajectories hold N x T training responses."""
    ctx = [TaskContext(index=10 + i, context_id=f"ctx{i}", task_type="pick_and_place_simple",
                       full_prompt_ids=(1, 2, 3 + i), fast_prompt_ids=(4, 5 + i)) for i in range(3)]
    for strategy in ("vanilla", "actfirst"):
        engine = RecordingEngine({"fast": 1.0, "full": 3.0})
        run = run_batch(engine, strategy, ctx, 4, Workload(fast_tokens=5, full_tokens=9), b_max=4, base_seed=3,
                        tag="s", check_events=True)
        assert run.num_samples == 3 * 4
        for req in engine.requests:
            _, task, turn, kind = parse_request_id(req.request_id)
            assert tuple(req.prompt_ids) == ctx[task].prompt_ids(kind)
            assert req.params.seed == request_seed(3, ctx[task].index, turn, kind)
            assert req.params.min_new_tokens == req.params.max_new_tokens == (5 if kind == "fast" else 9)
            assert req.params.stop_strings == ()
        assert len(engine.requests) == 3 * 4 * (1 if strategy == "vanilla" else 2)
    env = FixedContextEnv()
    first = env.reset(context_task(ctx[0], 0))
    assert [env.step("").text for _ in range(3)] == [first.text] * 3 and not env.step("look").done


def test_calibration_measures_the_first_turns_requests():
    engine = RecordingEngine({"fast": 1.0, "full": 3.0})
    run_batch(engine, "actfirst", contexts(2), 1, Workload(), b_max=4, base_seed=5)
    played = {(r.kind, tuple(r.prompt_ids), r.params) for r in engine.requests}
    engine.requests.clear()
    calibrate_latencies(engine, contexts(2), Workload(), full_token_lengths=(128,), measurements=1, base_seed=5)
    assert {(r.kind, tuple(r.prompt_ids), r.params) for r in engine.requests} == played


class ShortEngine:
    """A real-time engine (not a virtual clock) answering every request at once, one token short."""

    def __init__(self):
        self.max_concurrency = 1
        self.events = []

    def submit(self, request):
        n = request.params.max_new_tokens - 1
        future = Future()
        future.set_result(Result(request_id=request.request_id, kind=request.kind,
                                 prompt_ids=tuple(request.prompt_ids), token_ids=[0] * n, text="",
                                 logprobs=np.zeros(n, np.float32), finish_reason="stop",
                                 timings=Timings(0.0, 0.0, 0.0, 0.0)))
        return future

    def wait_idle(self, timeout=None):
        return True


def test_a_request_of_the_wrong_length_fails_the_batch():
    with pytest.raises(RuntimeError, match="the protocol fixes 16"):
        run_batch(ShortEngine(), "actfirst", contexts(2), 2, Workload(), b_max=2)

def test_request_seeds_depend_on_context_turn_and_kind_only():
    seeds = {request_seed(0, c, t, k) for c in range(5) for t in range(5) for k in ("fast", "full")}
    assert len(seeds) == 50
    assert request_seed(3, 1, 2, "full") == request_seed(3, 1, 2, "full") != request_seed(4, 1, 2, "full")


def test_calibration_measures_each_kind_alone():
    engine = SimulatedEngine(lambda r: 0.01 * r.params.max_new_tokens + (0.5 if r.kind == "fast" else 0.0))
    cal = calibrate_latencies(engine, contexts(3), Workload(), full_token_lengths=(128, 512), measurements=3)
    assert cal.medians("fast").tolist() == pytest.approx([0.66] * 3)
    assert cal.medians("full128").tolist() == pytest.approx([1.28] * 3)
    assert cal.median_of_medians("full512") == pytest.approx(5.12)
    assert all(len(m) == 3 for m in cal.measurements["fast"])
    assert check_concurrency_cap(engine.events, 1) == 1


def test_bad_batch_arguments():
    engine = SimulatedEngine({"fast": 1.0, "full": 2.0})
    with pytest.raises(ValueError):
        run_batch(engine, "think-then-act", contexts(2), 2, Workload(), b_max=2)
    with pytest.raises(ValueError):
        run_batch(engine, "vanilla", contexts(2), 0, Workload(), b_max=2)
    with pytest.raises(ValueError):
        run_batch(engine, "vanilla", contexts(2), 2, Workload(), b_max=0)      # engine rejects the cap
    with pytest.raises(ValueError):
        Workload(full_tokens=0)
    with pytest.raises(ValueError):
        make_batches(contexts(5), 3, 2)


def test_peak_concurrency_counts_a_finish_before_a_same_time_admit():
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1
    assert peak_concurrency([(0, 2), (1, 3), (1.5, 2.5)]) == 3


# --------------------------------------------------------------------------------------------- contexts
def test_proportional_allocation_largest_remainder():
    assert proportional_allocation({"a": 10, "b": 10, "c": 10}, 7) == {"a": 3, "b": 2, "c": 2}
    assert proportional_allocation({"a": 50, "b": 30, "c": 20}, 10) == {"a": 5, "b": 3, "c": 2}
    # 1024 draws over a pool of 600: exact shares 204.8, 3 x 170.67, 2 x 153.6; floors sum to 1020, the four
    # largest remainders (.8, .67, .67, .67) get one more
    pool = dict(zip("abcdef", (120, 100, 100, 100, 90, 90)))
    quota = proportional_allocation(pool, 1024)
    assert sum(quota.values()) == 1024
    assert quota == {"a": 205, "b": 171, "c": 171, "d": 171, "e": 153, "f": 153}


def test_sampling_is_proportional_seeded_and_mixes_types():
    types = [t for t in ALFWORLD_TASK_TYPES for _ in range(10)]
    picks = sample_proportionally(types, 24, seed=42)
    assert picks == sample_proportionally(types, 24, seed=42)
    assert picks != sample_proportionally(types, 24, seed=43)
    assert len(set(picks)) == 24                                       # without replacement while the pool lasts
    assert collections.Counter(types[i] for i in picks) == {t: 4 for t in ALFWORLD_TASK_TYPES}
    assert len({types[i] for i in picks[:8]}) > 2                      # shuffled, not grouped by type
    # more draws than the pool: every task drawn twice, then 4 of each type a third time
    many = sample_proportionally(types, 144, seed=42)
    counts = collections.Counter(many)
    assert sorted(collections.Counter(counts.values()).items()) == [(2, 36), (3, 24)]


def initial(i, task_type="pick_heat_then_place_in_recep"):
    return InitialContext(task_id=f"alfworld/train/game{i}", task_type=task_type,
                          instruction="Your task is to: put a hot tomato in garbagecan.",
                          observation="You are in the middle of a room. You see a fridge 1 and a microwave 1.",
                          admissible_actions=("go to fridge 1", "go to microwave 1", "inventory", "look"))


def test_snapshot_round_trip(tmp_path):
    cs = ContextSet((initial(0), initial(1), initial(0)), {"games": "generated", "seed": 42})
    path = save_context_set(tmp_path / "ctx.json", cs)
    back = load_context_set(path)
    assert back.contexts == cs.contexts
    assert back.source["seed"] == 42 and back.source["snapshot"] == str(path)
    assert len(back.head(2)) == 2
    with pytest.raises(ValueError):
        back.head(4)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError):
        load_context_set(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        InitialContext("x", "not_a_type", "q", "o", ("look",))


def test_tokenized_prompts_are_the_two_generation_modes():
    from jaxopd.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    cs = ContextSet((initial(0), initial(1)), {"games": "generated", "seed": 42})
    full, fast = tokenize_contexts(cs, tok)[0].full_prompt_ids, tokenize_contexts(cs, tok)[0].fast_prompt_ids
    full_text, fast_text = tok.decode(list(full)), tok.decode(list(fast))
    assert full_text.endswith("<|im_start|>assistant\n")                      # think-then-act: thinking on
    assert fast_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # action-only: empty think
    for text in (full_text, fast_text):
        assert "put a hot tomato in garbagecan" in text and "go to microwave 1" in text
    assert [c.index for c in tokenize_contexts(cs, tok)] == [0, 1]


def test_committed_snapshot_is_the_seed_42_proportional_sample():
    from jaxopd_experiments.actfirst_alfworld import SNAPSHOT_PATH, load_contexts
    cs = load_context_set(SNAPSHOT_PATH)
    src = cs.source
    assert len(cs) == 1024 and src["seed"] == 42 and src["split"] == "train"
    assert src["sampled_per_type"] == proportional_allocation(src["pool_per_type"], 1024)
    assert collections.Counter(c.task_type for c in cs.contexts) == src["sampled_per_type"]
    assert len({c.task_id for c in cs.contexts}) == src["distinct_tasks"] <= src["pool_size"]
    assert all(c.admissible_actions and c.instruction.startswith("Your task is to:") for c in cs.contexts)
    assert load_contexts(16, source="snapshot").contexts == cs.contexts[:16]
