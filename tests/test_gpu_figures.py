"""The GPU experiments' plotting and parsing logic, on small fixture files (no GPU needed)."""

import csv

import pytest

import loop_orders as lo
from experiments import gpu_figures, hw_traffic, plot_bench

NCU_HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context",
              "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name",
              "Metric Name", "Metric Unit", "Metric Value"]


def _ncu_row(launch, kernel, metric, unit, value):
    fields = [launch, "1", "python3", "h", kernel, "1", "7", "(256, 1, 1)", "(8, 8, 1)", "0",
              "9.0", "Command line profiler metrics", metric, unit, value]
    return ",".join(f'"{f}"' for f in fields)


NCU_CSV = "\n".join([
    "==PROF== Connected to process 1",
    ",".join(f'"{h}"' for h in NCU_HEADER),
    _ncu_row("0", "q_outer", "dram__bytes_read.sum", "Mbyte", "1.50"),
    _ncu_row("0", "q_outer", "gpu__time_duration.sum", "usecond", "12.5"),
    _ncu_row("1", "dense_pv", "dram__bytes_read.sum", "byte", "2,048"),
])


def test_parse_ncu_csv_groups_metrics_by_launch_and_scales_units():
    launches = hw_traffic.parse_ncu_csv(NCU_CSV)
    assert [k["name"] for k in launches] == ["q_outer", "dense_pv"]
    assert launches[0]["dram__bytes_read.sum"] == pytest.approx(1.5e6)
    assert launches[0]["gpu__time_duration.sum"] == pytest.approx(12500)
    assert launches[1]["dram__bytes_read.sum"] == 2048


def test_ncu_launches_are_summed_per_row_in_launch_order(capsys):
    """Each row takes its `kernels` launches in order; a launch count that does not add up
    leaves the rows alone and says so."""
    launches = [{"name": "a", "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum": 100.0},
                {"name": "b", "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum": 20.0,
                 "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum": 5.0},
                {"name": "c", "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum": 40.0}]
    rows = [{"kernels": 2, "counted_bytes": 125}, {"kernels": 1, "counted_bytes": 50}]
    assert not hw_traffic.fill_from_launches(rows, launches[:2], "demo")
    assert "demo: ncu reported 2 kernel launches, expected 3" in capsys.readouterr().out
    assert "ncu_ld_bytes" not in rows[0]
    assert hw_traffic.fill_from_launches(rows, launches, "demo")
    assert (rows[0]["ncu_ld_bytes"], rows[0]["ncu_st_bytes"]) == (120, 5)
    assert rows[0]["ncu_vs_counted"] == 0.0
    assert (rows[1]["ncu_ld_bytes"], rows[1]["ncu_st_bytes"]) == (0, 40)
    assert rows[1]["ncu_vs_counted"] == -0.2



def test_the_l1tex_line_rule_gives_the_excess_ncu_showed_for_each_cp_async_layout():
    """`hw_traffic.l1tex_copy_ratio` on the shared rows the kernels copy into: the mma.sync
    tiles (16-bit and TF32 rows padded by 16 bytes) 9/8, as ncu read for q_outer's loads
    (results/hw_traffic_tensor_cores.csv) and at decode (hw_traffic_gqa_decode.csv); the
    float32 CUDA-core kernel's K_j rows (padded) 9/8 and V_j rows (not) 1, 17 sectors a
    16-sector warp copy on average, as the probe counted; wgmma's swizzled 128-byte rows 1
    (ncu equal to the counts, hw_traffic_hopper.csv)."""
    from loop_orders.microkernel.spec import Layout, shared_layout
    from loop_orders.microkernel.tensor_cores import TensorCores, tc_shared_layout

    for kind, size in (("float16", 2), ("tf32", 4)):
        for d in (64, 128):
            sm = tc_shared_layout(64, 64, d, d, False, TensorCores(kind))
            for stride in (sm.qs, sm.ks, sm.vs):
                assert hw_traffic.l1tex_copy_ratio(d * size, stride * size) == 9 / 8
    sm = shared_layout(64, 64, 64, 64, Layout(8, 8, 2), False)  # K_j, V_j by cp.async
    ratios = [hw_traffic.l1tex_copy_ratio(64 * 4, s * 4) for s in (sm.ks, sm.vs)]
    assert ratios == [9 / 8, 1.0]
    assert hw_traffic.l1tex_copy_sectors(64 * 4, sm.ks * 4, 2) == 18  # one warp copy: 2 rows
    assert hw_traffic.l1tex_copy_ratio(128, 128) == 1.0  # swizzled: whole lines
    # a decode block's query rows: one row starts a line (nothing twice), four hold two odd
    assert hw_traffic.l1tex_copy_ratio(256, 272, rows=1) == 1.0
    assert hw_traffic.l1tex_copy_ratio(256, 272, rows=4) == 9 / 8

def _write(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_plot_hw_and_refusal_of_wrong_file(tmp_path):
    base = {"dtype": "float32", "causal": "False", "device": "fixture", "git_sha": "f" * 40,
            "date": "2026-11-30", "batch": 2, "heads": 4, "block_q": 64, "block_k": 64}
    rows = [{**base, "schedule": s, "n": n, "model_bytes": 4 * n * n,
             "counted_bytes": 4 * n * n, "ncu_ld_bytes": 3 * n * n, "ncu_st_bytes": n * n,
             "dram_read_bytes": n * n, "dram_write_bytes": n * n}
            for s in ("a", "b") for n in (256, 512, 1024)]
    _write(tmp_path / "hw_traffic.csv", rows)
    loaded = plot_bench.read_rows(tmp_path / "hw_traffic.csv", "ncu_ld_bytes")
    paths = gpu_figures.plot_hw(loaded, tmp_path / "fig")
    assert {p.name for p in paths} == {"hw_traffic.png", "hw_traffic.pdf", "hw_traffic_l2.png",
                                       "hw_traffic_l2.pdf"}
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    with pytest.raises(ValueError, match="no column 'provider'"):
        plot_bench.read_rows(tmp_path / "hw_traffic.csv", "provider")


def test_bench_sweep_resumes_points_of_the_same_commit(tmp_path, monkeypatch):
    from experiments import bench_runtime as bench
    from loop_orders.results import provenance

    monkeypatch.setattr(bench, "PROV", provenance())
    measured = []

    def fake_measure(name, dtype, what, p, rng):
        measured.append(p.n_q)
        return {**bench.blank_row(name, dtype, what, p), "ms_median": p.n_q / 1000}

    monkeypatch.setattr(bench, "measure", fake_measure)
    sweep = {"n": [512, 1024], "d": [64], "causal": [False]}
    bench.run_sweep(tmp_path, {**sweep, "n": [512]}, {"q_outer"}, rng=None)
    rows = bench.run_sweep(tmp_path, sweep, {"q_outer"}, rng=None)  # resumes N=512
    assert measured == [512, 1024]
    assert [int(r["n"]) for r in rows] == [512, 1024]
    assert [r["layout"] for r in rows] == ["8,8"] * 2  # q_outer at Br x Bc = 128 x 64, d = 64
    with (tmp_path / "bench_runtime.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2


def test_backward_sweep_times_what_a_call_naming_no_tiles_runs(tmp_path, monkeypatch,
                                                                backward_tiles_16x8):
    """bench_backward.csv's rows: each pass on the tiles a call naming none chooses (the
    forward's in block_q, block_k, the backward's in backward_tiles), the torch op naming
    none; --grad-tiles' builds on theirs (a second pair the backward's, the op not timed);
    the notes' model and tiles read the backward's."""
    from experiments import bench_runtime as bench
    from experiments import gpu_notes
    from loop_orders.results import provenance

    monkeypatch.setattr(bench, "PROV", provenance())
    monkeypatch.setenv("LOOP_ORDERS_SIMULATOR_BUDGET_S", "1e12")  # checks only: none runs
    timed = []

    def fake_grad(name, options, p, rng, op_tiles):
        pb = p.for_backward()
        timed.append(((p.block_q, p.block_k), (pb.block_q, pb.block_k), op_tiles))
        return 1.0, 2.0, 3.5, 1e-6

    monkeypatch.setattr(bench, "bench_grad", fake_grad)
    monkeypatch.setattr(bench, "bench_torch_grad", lambda *args: 3.0)
    sweep = {"n": [256], "d": [64], "causal": [False]}
    rows = bench.run_backward(tmp_path, sweep, None, only={"q_outer"}, dtypes=("float32",))
    assert timed == [((64, 64), (16, 8), (None, None))] * 2  # dq atomic, separate
    ours = [r for r in rows if r["block_q"]]
    assert [(r["block_q"], r["block_k"], r["backward_tiles"]) for r in ours] == \
        [(64, 64, "16x8")] * 2
    assert gpu_notes._backward_model(ours[0]) == lo.predict_traffic(
        "q_outer", 256, 64, batch=ours[0]["batch"], heads=ours[0]["heads"], block_q=16,
        block_k=8, save_lse=True, options={"dq": "atomic"}, backward=True)
    summary = gpu_notes.backward_summary(tmp_path)
    assert "q_outer dq=atomic (forward 64x64, backward 16x8)" in summary
    builds = [bench.grad_build(text) for text in ("32x32", "64x64,16x16/1")]
    assert builds[1] == bench.GradTiles(64, 64, 1, (16, 16)) and builds[1].label() == \
        "64x64,16x16/1"
    timed.clear()
    rows = bench.run_backward(tmp_path, sweep, None, only={"q_outer"}, dtypes=("float32",),
                              tiles=tuple(builds))
    assert timed == [((32, 32), (32, 32), (32, 32)), ((64, 64), (16, 16), None)] * 2
    assert (tmp_path / "bench_backward_tiles.csv").exists()


def test_plot_blocksize_draws_traffic_and_runtime(tmp_path):
    base = {"device": "fixture", "git_sha": "f" * 40, "date": "2026-11-30", "n": 4096,
            "d": 64, "batch": 4, "heads": 16, "block_k": 64}
    rows = [{**base, "schedule": "q_outer", "block_q": bq, "model_bytes": 2**40 // bq,
             "ms_median": "" if bq == 16 else 10 + bq / 100,
             "status": "refused: fixture" if bq == 16 else "ok"} for bq in (16, 32, 64)]
    _write(tmp_path / "bench_blocksize.csv", rows)
    loaded = plot_bench.read_rows(tmp_path / "bench_blocksize.csv", "model_bytes")
    paths = gpu_figures.plot_blocksize(loaded, tmp_path / "fig")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def test_tuning_picks_the_fastest_of_our_configurations_and_resumes(tmp_path, monkeypatch):
    from experiments import bench_runtime as bench

    monkeypatch.setattr(bench, "PROV", {"git_sha": "abc"})
    rows = [
        {"schedule": "torch_sdpa_efficient", "d": 64, "block_q": "", "block_k": "",
         "layout": "", "ms_median": 1.0, "status": "ok"},
        {"schedule": "q_outer", "d": 64, "block_q": 128, "block_k": 64, "layout": "1,2",
         "ms_median": 3.0, "status": "ok"},
        {"schedule": "q_outer", "d": 64, "block_q": 128, "block_k": 32, "layout": "2,2",
         "ms_median": 2.0, "status": "ok"},
        {"schedule": "q_outer", "d": 64, "block_q": 64, "block_k": 32, "layout": "2,4",
         "ms_median": "", "status": "refused: fixture"},
        {"schedule": "q_outer", "d": 128, "block_q": 64, "block_k": 16, "layout": "2,4",
         "ms_median": 5.0, "status": "ok"},
    ]
    assert bench.fastest_configs(rows) == {64: (128, 32, "2,2"), 128: (64, 16, "2,4")}
    bench.write_csv(tmp_path / "bench_layouts.csv", rows, {"git_sha": "abc"})
    again = bench.finished_tuning(tmp_path / "bench_layouts.csv")
    assert bench.fastest_configs(again) == {64: (128, 32, "2,2"), 128: (64, 16, "2,4")}
    monkeypatch.setattr(bench, "PROV", {"git_sha": "another commit"})
    assert bench.finished_tuning(tmp_path / "bench_layouts.csv") == []


def test_gpu_notes_blocks_from_committed_results_and_without_them(tmp_path):
    from experiments import gpu_notes
    from experiments.common import REPO_ROOT

    committed = gpu_notes.blocks(REPO_ROOT / "results")
    assert "Not measured yet" not in "".join(committed.values())
    assert "largest |ncu L1 bytes − counted| / counted" in committed["hw-traffic"]
    assert "q_outer / SDPA efficient" in committed["bench-summary"]
    empty = gpu_notes.blocks(tmp_path)
    assert all(v.startswith("*Not measured yet") for v in empty.values())
    assert gpu_notes.provenances(tmp_path) == []


def test_hw_traffic_sweep_covers_every_schedule_and_tile_size_and_fits():
    import loop_orders as lo

    cfgs = hw_traffic.configs(quick=False)
    assert {c["schedule"] for c in cfgs} == set(lo.schedule_names())
    assert {(c["block_q"], c["block_k"]) for c in cfgs} == set(hw_traffic.SWEEP["blocks"])
    for c in cfgs:  # every configuration is within the kernels' shared-memory limits
        p = hw_traffic.problem(c)
        sched = lo.get_schedule(c["schedule"])
        assert all(k.shared_bytes <= k.shared_limit for k in sched.kernels(p, True))
    profiled = hw_traffic.kernel_regex(cfgs).removeprefix("regex:").split("|")
    for c in cfgs:  # every kernel of every configuration is profiled
        sched = lo.get_schedule(c["schedule"])
        assert {k.name for k in sched.kernels(hw_traffic.problem(c), False)} <= set(profiled)


@pytest.mark.parametrize("name, required, draw", [
    ("bench_decode.csv", "n_k", gpu_figures.plot_decode),
    ("bench_backward.csv", "ms_backward", gpu_figures.plot_backward),
    ("train_tiny.csv", "loss", gpu_figures.plot_train),
    ("fig2_setting.csv", "counted_bytes", gpu_figures.plot_fig2),
])
def test_this_rounds_gpu_figures_draw_from_the_committed_results(name, required, draw,
                                                                  tmp_path):
    from experiments.common import REPO_ROOT

    rows = plot_bench.read_rows(REPO_ROOT / "results" / name, required)
    paths = draw(rows, tmp_path)
    assert len(paths) == 2 and all(p.stat().st_size > 1000 for p in paths)


def test_this_rounds_notes_blocks_read_the_committed_results():
    from experiments import gpu_notes
    from experiments.common import REPO_ROOT

    committed = gpu_notes.blocks(REPO_ROOT / "results")
    assert "Target shape (N_q = 1, B·H = 16, N_k = 65536" in committed["decode-summary"]
    assert "backward model GB" in committed["backward-bench"]
    assert "| 4096 | 64 | no | float16 | q_outer" in committed["backward-summary"]
    assert "Model = counted in 24 of 24 rows" in committed["fig2-setting"]
    assert "SDPA" in committed["train-summary"] and "cache" in committed["host-overhead"]


def test_hw_traffic_backward_configurations_profile_the_backward_kernels_only():
    """With --backward ncu's filter names the backward's kernels, none of the forward's that
    runs first, and a schedule option reaches every configuration's Problem."""
    cfgs = hw_traffic.configs(True, ["float16"], ["q_outer"], backward=True,
                              options={"dq": "separate"})
    assert cfgs and all(cfg["backward"] for cfg in cfgs)
    names = set(hw_traffic.kernel_regex(cfgs).removeprefix("regex:").split("|"))
    forward = {kern.name for cfg in cfgs for kern in
               lo.get_schedule("q_outer").kernels(hw_traffic.problem(cfg), False)}
    assert names and not names & forward
    assert all(hw_traffic.problem(cfg).option("dq") == "separate" for cfg in cfgs)


def test_gqa_decode_configurations_and_their_reference():
    """hw_traffic --gqa-decode: packed decode is one block of a group's rows with no mask
    (K/V read once per group), per head keeps the grouping; the GPU check's reference reads
    query head h's K/V head h // group, causal bottom-right aligned."""
    import numpy as np

    from experiments import gpu_common

    problems = [hw_traffic.problem(cfg) for cfg in hw_traffic.decode_configs([4096])]
    assert {(p.n_q, p.group, p.causal) for p in problems} == {(4, 1, False), (1, 4, True)}
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 3, 8))
    k, v = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 6))
    got = gpu_common.reference_rows(q, k, v, [0, 3], np.arange(3), True, group=2)
    for i, h in enumerate((0, 3)):
        want, _ = lo.attention_reference(q[h], k[h // 2], v[h // 2], causal=True)
        assert np.allclose(got[i], want)
