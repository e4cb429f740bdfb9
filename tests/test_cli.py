import json

import pytest
from conftest import SCHEDULES

import loop_orders as lo
from loop_orders.cli import main
from loop_orders.core.ledger import TENSORS


def test_schedules_lists_the_registry(capsys):
    assert main(["schedules", "--loop-nest"]) == 0
    out = capsys.readouterr().out
    for name in SCHEDULES:
        assert name in out
        assert lo.get_schedule(name).loop_nest().splitlines()[0].strip() in out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_traffic_json_contract(schedule, capsys):
    argv = ["traffic", "--schedule", schedule, "--n", "6", "--d", "2", "--block-q", "2",
            "--block-k", "3", "--causal", "--measure", "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    sched = lo.get_schedule(schedule)
    keys = ["schedule", "n", "d", "dv", "batch", "heads", "block_q", "block_k", "causal",
            "save_lse", *(["options"] if sched.OPTIONS else []), "model", "measured", "backend"]
    assert list(record) == keys
    assert record["schedule"] == schedule and record["causal"] is True
    assert list(record["model"]) == list(sched.ledger_tensors())
    assert list(record["model"])[:len(TENSORS)] == list(TENSORS)
    assert record["model"] == record["measured"]
    assert record["backend"] in ("gpu", "simulator")
    expected = lo.predict_traffic(schedule, n=6, d=2, block_q=2, block_k=3, causal=True)
    assert record["model"] == expected.to_dict()


def test_traffic_without_measure_has_no_measured_keys(capsys):
    assert main(["traffic", "--schedule", "q_outer", "--n", "6", "--d", "2", "--block-q", "2",
                 "--block-k", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert "measured" not in record and "backend" not in record
    assert sum(v["read"] + v["write"] for v in record["model"].values()) == 96


def test_traffic_table_and_run(capsys):
    assert main(["traffic", "--schedule", "kv_outer", "--n", "10", "--d", "3", "--block-q",
                 "4", "--block-k", "3", "--measure"]) == 0
    assert "equal to the model" in capsys.readouterr().out
    assert main(["run", "--schedule", "q_outer", "--n", "12", "--d", "5", "--dv", "3",
                 "--block-q", "4", "--block-k", "5", "--causal", "--dtype", "float16",
                 "--repeat", "1"]) == 0
    assert "ok, tolerance" in capsys.readouterr().out


WITH_OPTIONS = [s for s in lo.all_schedules() if s.OPTIONS]


@pytest.mark.parametrize("sched", WITH_OPTIONS, ids=[s.name for s in WITH_OPTIONS])
def test_options_on_the_command_line(sched, capsys):
    key, opt = next(iter(sched.OPTIONS.items()))
    value = opt.examples[0]
    argv = ["traffic", "--schedule", sched.name, "--n", "9", "--d", "2", "--block-q", "2",
            "--block-k", "2", "--option", f"{key}={value}", "--measure", "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["options"][key] == opt.check(str(value))
    assert record["model"] == record["measured"]
    assert record["model"] == lo.predict_traffic(sched.name, n=9, d=2, block_q=2, block_k=2,
                                                 options={key: value}).to_dict()
    assert main(["schedules"]) == 0
    assert f"--option {key}={opt.default}" in capsys.readouterr().out


@pytest.mark.parametrize("sched", WITH_OPTIONS, ids=[s.name for s in WITH_OPTIONS])
def test_bad_options_exit_2_with_one_line(sched, capsys):
    key = next(iter(sched.OPTIONS))
    for option, pattern in ((f"{key}=%%bad%%", f"options: {key} of {sched.name}: got "),
                            ("no_such_option=3", f"options: unknown option 'no_such_option' "
                                                 f"for {sched.name}; its options: {key}"),
                            (key, "--option: expected key=value")):
        argv = ["traffic", "--schedule", sched.name, "--n", "9", "--d", "2", "--option", option]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and pattern in err, err


def test_options_of_a_schedule_without_any(capsys):
    plain = next(s for s in lo.all_schedules() if not s.options_for({}))
    argv = ["traffic", "--schedule", plain.name, "--n", "9", "--d", "2", "--option", "x=1"]
    assert main(argv) == 2
    assert f"unknown option 'x' for {plain.name}; its options: none" in capsys.readouterr().err


def test_headers_name_the_options_of_the_pass_that_runs(capsys):
    """A forward header leaves out dq (a backward option); the backward's header keeps it."""
    base = ["--schedule", "q_outer", "--n", "6", "--d", "2", "--block-q", "2", "--block-k", "2"]
    for argv in (["traffic", *base], ["run", *base]):
        assert main(argv) == 0
        assert "dq=" not in capsys.readouterr().out.splitlines()[0]
    assert main(["traffic", "--backward", *base]) == 0
    assert "dq=atomic" in capsys.readouterr().out.splitlines()[0]
    assert main(["traffic", "--schedule", "split_kv", "--n", "1", "--n-k", "8", "--d", "2",
                 "--block-k", "4", "--option", "splits=2"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "splits=2" in header and "dq=" not in header


def test_cache_under_the_simulator_says_nothing_is_cached_there(capsys, monkeypatch, tmp_path):
    from loop_orders.device import runtime

    monkeypatch.setenv("LOOP_ORDERS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "SIMULATOR", True)
    assert main(["cache"]) == 0
    assert "compiles nothing" in capsys.readouterr().out


def test_warm_checks_a_sweep_and_refuses_bad_names(capsys):
    """Under the simulator `warm` checks every call of the sweep (nothing compiles here); an
    unknown schedule or an impossible tile is one line and exit status 2."""
    assert main(["warm", "--schedules", "q_outer", "kv_outer", "--d", "64", "96",
                 "--dtypes", "float16", "float32", "--backward"]) == 0
    assert "16 calls checked" in capsys.readouterr().out
    assert main(["warm", "--schedules", "nope"]) == 2
    assert "unknown schedule 'nope'" in capsys.readouterr().err
    assert main(["warm", "--d", "1000"]) == 2


def test_warm_records_every_kernel_of_a_forward_and_backward_call():
    """The launches `warm` compiles are a call's own: q_outer's backward adds its kernels
    to the forward's, each with the arrays of the problem's shapes."""
    from loop_orders.sweeps import sweep_jobs
    from loop_orders.warm import recorded_launches

    (job,) = sweep_jobs(["q_outer"], [64], ["float16"], causal=(True,), backward=True)
    forward = recorded_launches(lo.get_schedule("q_outer"), job.problem, False, False)
    both = recorded_launches(lo.get_schedule("q_outer"), job.problem, False, True)
    assert len(forward) == 1 and len(both) > len(forward)
    assert all(kernel is not None and shared >= 0 for kernel, _, _, shared, _ in both)


def test_compile_ahead_compiles_a_new_calls_kernels_at_once(monkeypatch, tmp_path):
    """A new shape's kernels not yet built: the first compiles here, each other in a worker
    process of its own (the payload names the build by its factory and argument types, with
    the device's compute capability and the cache's environment: the worker has no CUDA
    context); the call goes on once the first is built, and the first launch of a worker's
    build waits for that worker (once) before it loads the build; a build being compiled
    elsewhere is not handed out again; one missing build, or LOOP_ORDERS_COMPILE_AHEAD=0,
    starts no process. The processes and the compiler are stood in for (no GPU here): what
    is checked is who compiles what, and when a launch waits."""
    import io
    import pickle

    from loop_orders import sweeps, warm
    from loop_orders.device import kernel_cache, runtime

    (job,) = sweeps.sweep_jobs(["q_outer"], [64], ["float16"], causal=(True,), backward=True)
    launches = warm.recorded_launches(lo.get_schedule("q_outer"), job.problem, False, True)
    here, payloads, waited, workers = [], [], [], []

    class Worker:
        def __init__(self, argv, **_):
            assert argv[1:] == ["-c", warm._WORKER]
            self.stdin = io.BytesIO()
            self.stdin.close = lambda: payloads.append(pickle.loads(self.stdin.getvalue()))

        def wait(self):
            waited.append(payloads[workers.index(self)][0])
            return 0

    def new_worker(*args, **kwargs):
        workers.append(Worker(*args, **kwargs))
        return workers[-1]

    monkeypatch.setattr(runtime, "SIMULATOR", False)
    monkeypatch.setattr(runtime, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(kernel_cache, "environment", lambda: ("env",))
    monkeypatch.setattr(kernel_cache, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(runtime, "is_cached", lambda kernel, args: False)
    monkeypatch.setattr(runtime, "_COMPILING", {})
    monkeypatch.setattr(runtime, "_compile", lambda kernel, args, shared: here.append(kernel))
    monkeypatch.setattr(warm.subprocess, "Popen", new_worker)
    builds = list(dict.fromkeys(runtime.build_key(kernel, args)
                                for kernel, _, _, _, args in launches))
    assert warm.compile_ahead(job) == len(builds) > 2
    # here: its own build; the workers' are awaited by their launches, not yet
    assert here == [builds[0][0]] and waited == []
    assert payloads == [(runtime.factory_key(kernel), sig, (9, 0), ("env",))
                        for kernel, sig in builds[1:]]
    assert warm.compile_ahead(job) == 0  # being compiled: not handed out again
    # a worker's build at its launch: its worker awaited once, then loaded from the cache
    kernel, sig = builds[1]
    loaded = object()
    monkeypatch.setattr(kernel_cache, "load", lambda factory_key, sig: loaded)
    monkeypatch.setattr(runtime, "_BUILT", {})
    assert waited == []
    assert runtime._built(kernel, sig) is loaded and waited == [runtime.factory_key(kernel)]
    assert runtime._built(kernel, sig) is loaded and waited == [runtime.factory_key(kernel)]

    monkeypatch.setenv("LOOP_ORDERS_COMPILE_AHEAD", "0")
    assert warm.compile_ahead(job) == 0
    monkeypatch.delenv("LOOP_ORDERS_COMPILE_AHEAD")
    monkeypatch.setattr(runtime, "is_cached", lambda kernel, args: kernel is not launches[1][0])
    assert warm.compile_ahead(job) == 0 and len(here) == 1


def test_a_compile_worker_links_its_cubin_only_where_no_gpu_is_needed(monkeypatch):
    """A compile worker links the PTX to a cubin itself where cuda.core links by nvJitLink
    (no CUDA context), so the loading process only loads it; with the driver's linker (it
    needs a context) it leaves the linking to the loading process."""
    import types

    from loop_orders.device import runtime

    assert runtime.linker_backend() in ("nvJitLink", "driver")
    asked = []
    compiled = types.SimpleNamespace(_codelibrary=types.SimpleNamespace(
        get_cubin=lambda cc: asked.append(cc)))
    for backend, links in (("nvJitLink", True), ("driver", False)):
        monkeypatch.setattr(runtime, "linker_backend", lambda b=backend: b)
        asked.clear()
        assert runtime.link_without_a_device(compiled, (9, 0, "a")) is links
        assert asked == ([(9, 0, "a")] if links else [])


def test_a_compile_worker_remakes_a_kernel_from_its_factory_key():
    """What a worker is sent names the kernel: its factory, called again with the same
    compile-time constants, gives the same kernel (the factories' cache)."""
    from loop_orders import sweeps, warm
    from loop_orders.device import runtime

    (job,) = sweeps.sweep_jobs(["q_outer"], [64], ["float16"], causal=(True,), backward=True)
    for kernel, *_ in warm.recorded_launches(lo.get_schedule("q_outer"), job.problem, False,
                                             True):
        made_by = runtime.factory_key(kernel)
        assert made_by is not None and runtime.kernel_of(made_by) is kernel


def test_a_warm_job_compiles_its_tuning_override():
    """A Job naming a `tuning.tuned` override records the builds that override runs (a
    sweep's row warmed ahead), and one naming none the caller's: the causal grid by groups
    of heads is a build of its own."""
    from loop_orders import warm
    from loop_orders.device import runtime
    from loop_orders.microkernel import tuning

    p = lo.make_problem("q_outer", n_q=128, d=64, batch=1, heads=2, causal=True, block_q=64,
                        block_k=64, dtype="float16")

    def layouts(job):
        return [runtime.factory_key(kernel)[2][4] for kernel, *_ in warm.job_launches(job)]

    (default,) = layouts(warm.Job("q_outer", p))
    (grouped,) = layouts(warm.Job("q_outer", p, tuned=(("causal_heads", 2),)))
    assert (default.causal_heads, grouped.causal_heads) == (0, 2)
    with tuning.tuned(causal_heads=2):
        assert layouts(warm.Job("q_outer", p)) == [grouped]


def test_warm_drops_what_the_api_refuses():
    """A sweep's job whose backward the API refuses (kv_outer's float32 backward at d = 128 on
    64 x 64 tiles needs more shared memory than a CTA may take: its build would not load)
    warms its forward only; one whose forward is refused is dropped."""
    from loop_orders import sweeps, warm

    (job,) = sweeps.sweep_jobs(["kv_outer"], [128], ["float32"], causal=(False,), backward=True,
                             block_q=64, block_k=64)
    assert warm._accepted(job) == job._replace(backward=False)
    (fits,) = sweeps.sweep_jobs(["kv_outer"], [64], ["float32"], causal=(False,), backward=True)
    assert warm._accepted(fits) == fits
    (huge,) = sweeps.sweep_jobs(["q_outer"], [256], ["float32"], causal=(False,), block_q=512,
                              block_k=512)
    assert warm._accepted(huge) is None


def test_traffic_of_a_packed_batch(capsys):
    """--cu-seqlens-q/-k: the sequences' summed model, and the counted backward equal to it;
    --n beside them refused."""
    base = ["traffic", "--schedule", "q_outer", "--cu-seqlens-q", "0,5,5,12",
            "--cu-seqlens-k", "0,9,11,18", "--d", "4", "--heads", "2", "--kv-heads", "1",
            "--block-q", "4", "--block-k", "4", "--causal"]
    assert main([*base, "--backward", "--measure", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "3 packed sequences, queries [5, 0, 7]" in out and "equal to the model" in out
    assert main([*base, "--n", "12"]) == 2
    assert "leave out --n" in capsys.readouterr().err
