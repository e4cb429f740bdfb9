"""Experiment logic on tiny sizes: sweep declarations, fitting, results I/O, resume, and the
`loop-orders figures --quick` command end to end (so CI keeps the figures from rotting)."""

import json
import os
import threading

import pytest

import loop_orders as lo
from experiments import common, explainer, notes, theorem2, traffic
from loop_orders import results
from loop_orders.cli import main


def fake_provenance():
    return {"git_sha": "test", "backend": "simulator", "device": "test", "date": "today"}


# --- results I/O ------------------------------------------------------------------------

def test_provenance_fields():
    p = results.provenance(extra="x")
    assert {"git_sha", "backend", "device", "versions", "date", "extra"} <= set(p)
    assert {"python", "numpy", "numba-cuda", "scipy"} <= set(p["versions"])


def test_results_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV_RESULTS_DIR, str(tmp_path))
    assert results.results_dir() == tmp_path
    assert results.results_dir(tmp_path / "x") == tmp_path / "x"


def test_atomic_write_replaces_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "r.json"
    results.atomic_write_json(target, {"a": 1})
    results.atomic_write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["r.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path):
    target = tmp_path / "r.json"
    results.atomic_write_json(target, {"a": 1})
    with pytest.raises(TypeError):
        results.atomic_write_json(target, {"a": object()})  # not serialisable
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["r.json"]


def test_readers_never_see_a_partial_file(tmp_path):
    target = tmp_path / "r.json"
    results.atomic_write_json(target, {"x": list(range(20000))})
    stop, bad = threading.Event(), []

    def read():
        while not stop.is_set():
            try:
                json.loads(target.read_text())
            except json.JSONDecodeError as exc:
                bad.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(30):
        results.atomic_write_json(target, {"x": list(range(20000 + i))})
    stop.set()
    reader.join()
    assert not bad


def _sweep(tmp_path, **kw):
    return results.Sweep("demo", tmp_path, meta={"d": 4}, provenance_fn=fake_provenance, **kw)


def test_sweep_resumes_without_redoing_or_losing_points(tmp_path):
    calls = []

    def evaluate(config):
        calls.append(config["n"])
        if config["n"] == 3 and len(calls) == 3:
            raise KeyboardInterrupt  # interrupted while measuring the third point
        return {"value": config["n"] ** 2}

    configs = [{"n": n} for n in (1, 2, 3, 4)]
    with pytest.raises(KeyboardInterrupt):
        _sweep(tmp_path).run(configs, evaluate, progress=False)
    stored = results.load(tmp_path / "demo.json")
    assert [r["key"]["n"] for r in stored["records"]] == [1, 2] and not stored["complete"]
    sweep = _sweep(tmp_path)
    sweep.run(configs, evaluate, progress=False)
    sweep.finish()
    assert calls == [1, 2, 3, 3, 4]  # 1 and 2 not redone
    data = results.load(tmp_path / "demo.json")
    assert [r["value"] for r in data["records"]] == [1, 4, 9, 16] and data["complete"]
    assert len(data["runs"]) == 2 and [r["run"] for r in data["records"]] == [0, 0, 1, 1]


def test_sweep_keys_ignore_order_and_refuse_duplicates(tmp_path):
    sweep = _sweep(tmp_path)
    sweep.add({"a": 1, "b": 2}, {"v": 0})
    assert sweep.done({"b": 2, "a": 1})
    with pytest.raises(ValueError, match="already stored"):
        sweep.add({"b": 2, "a": 1}, {"v": 1})


def test_sweep_refuses_other_declaration_unless_fresh(tmp_path):
    _sweep(tmp_path).add({"n": 1}, {"v": 1})
    with pytest.raises(results.ResultsError, match="different sweep declaration"):
        results.Sweep("demo", tmp_path, meta={"d": 8})
    fresh = results.Sweep("demo", tmp_path, meta={"d": 8}, fresh=True)
    assert fresh.records() == []


@pytest.mark.parametrize("damage, message", [
    (lambda t: t[: len(t) // 2], "corrupt or partial"),
    (lambda t: "", "corrupt or partial"),
    (lambda t: json.dumps({"format": "other"}), "not a loop_orders.results/1"),
    (lambda t: t.replace('"n_records": 2', '"n_records": 3'), "partial results file"),
    (lambda t: t.replace('"provenance"', '"provenanc"'), "lacks 'provenance'"),
])
def test_damaged_results_file_is_refused_clearly(tmp_path, damage, message):
    sweep = _sweep(tmp_path)
    sweep.add({"n": 1}, {"v": 1})
    sweep.add({"n": 2}, {"v": 2})
    path = tmp_path / "demo.json"
    path.write_text(damage(path.read_text()))
    with pytest.raises(results.ResultsError, match=message) as info:
        results.load(path)
    assert str(path) in str(info.value)
    with pytest.raises(results.ResultsError):
        _sweep(tmp_path)  # nor is it resumed from


def test_missing_results_file_says_how_to_make_it(tmp_path):
    with pytest.raises(results.ResultsError, match="loop-orders figures"):
        results.load(tmp_path / "nothing.json")


# --- sweep declarations -----------------------------------------------------------------

def test_traffic_sweep_covers_every_registered_schedule():
    configs = traffic.configs(traffic.QUICK_SWEEP)
    names = {c["schedule"] for c in configs}
    assert names == set(lo.schedule_names())
    per = len(traffic.QUICK_SWEEP["n"]) * len(traffic.QUICK_SWEEP["blocks"]) * len(
        traffic.QUICK_SWEEP["causal"])
    assert len(configs) == per * len(names)
    assert len({results.config_key(c) for c in configs}) == len(configs)


def test_theorem2_sweeps_stay_in_the_theorem_range():
    for decl in (theorem2.SWEEP, theorem2.QUICK_SWEEP):
        for c in theorem2.configs(decl):
            assert lo.theory.in_theorem2_range(c["n"], c["d"], c["m"]), c
        kernel = [c for c in theorem2.configs(decl) if c["set"] == "kernel"]
        assert max(c["n"] for c in kernel) <= common.SIMULATOR_MAX_N


def test_model_traffic_counts_a_routed_training_step_equal_to_the_model():
    """experiments/model_traffic.py's row for one run on its tiny shape: every layer's passes
    counted, summed equal to the model, the gradients those of torch's own step."""
    torch = pytest.importorskip("torch")
    from experiments import model_traffic as mt
    from loop_orders.core.schedule import GradVariant

    model = mt.gpt2(mt.TINY)
    idx, targets = mt.batch(mt.TINY, "cpu")
    _, reference = mt.train_step(model, idx, targets)
    row, grads = mt.routed_run(model, mt.TINY, GradVariant("kv_outer", "kv_outer", None), idx,
                               targets)
    assert torch.nn.functional.scaled_dot_product_attention is \
        torch._C._nn.scaled_dot_product_attention  # use() gave torch's back
    for pass_ in ("forward", "backward"):
        assert row[pass_]["equals_model"] and row[pass_]["calls"] == mt.TINY.layers
        assert row[pass_]["bytes"] == 4 * row[pass_]["elements"]  # float32: 4 bytes each
    assert mt.grad_error(grads, reference) <= 1e-5
    json.dumps(row)


def test_measurable_labels_simulator_points(monkeypatch):
    sched = lo.get_schedule("q_outer")
    small = common.problem(sched, 32, 4, 8, 8)
    big = common.problem(sched, 1024, 16, 16, 16)
    assert common.measurable(sched, small, "simulator")
    assert not common.measurable(sched, big, "simulator")
    assert common.measurable(sched, big, "gpu")
    huge_tile = common.problem(sched, 1024, 256, 16, 512)  # shared memory would not fit
    assert not common.measurable(sched, huge_tile, "gpu")


def test_traffic_point_measures_small_and_models_large():
    small = traffic.evaluate({"schedule": "kv_outer", "n": 16, "d": 4, "block_q": 8,
                              "block_k": 4, "causal": True})
    assert small["measured"] == small["model"] and small["backend"] == "simulator"
    big = traffic.evaluate({"schedule": "kv_outer", "n": 4096, "d": 16, "block_q": 16,
                            "block_k": 16, "causal": False})
    assert big["measured"] is None and big["model"]["q"]["read"] > 0
    assert traffic.residuals([{"key": {"n": 16}, **small}])[0]["max_abs"] == 0


def test_theorem2_fit_slopes_on_model_points():
    decl = {"m": {"model": {"n": 2048, "d": 8, "m": [64, 128, 256, 512, 1024]}}}
    records = [{"key": c, **{"model": lo.get_schedule(c["schedule"]).model(
        common.problem(lo.get_schedule(c["schedule"]), c["n"], c["d"],
                       *lo.get_schedule(c["schedule"]).tiles_for_sram(c["m"], c["d"]))
    ).to_dict(), "measured": None}} for c in theorem2.configs(decl)]
    fits = {(f["schedule"], f["window"]): f for f in theorem2.fit_slopes({"records": records})}
    assert fits[("kv_outer", "theorem")]["slope"] == pytest.approx(-1, abs=0.1)
    assert fits[("kv_outer", "theorem")]["expected"] == -1
    assert fits[("kv_outer", "theorem")]["stderr"] >= 0


def test_every_block_is_marked_in_the_paper_or_its_appendix_once():
    marked = [name for path in (common.NOTES_PATH, notes.appendix_path(common.NOTES_PATH))
              for name in notes.marked_blocks(path.read_text(encoding="utf-8"))]
    assert len(marked) == len(set(marked))
    assert notes.appendix_path(common.NOTES_PATH).name == "paper_notes_appendix.md"


def test_notes_blocks_are_replaced_and_missing_markers_refused():
    text = "a\n<!-- BEGIN generated:x -->\nold\n<!-- END generated:x -->\nb\n"
    out = notes.replace_blocks(text, {"x": "new 1\nnew 2"})
    assert out == "a\n<!-- BEGIN generated:x -->\nnew 1\nnew 2\n<!-- END generated:x -->\nb\n"
    assert notes.replace_blocks(out, {"x": "new 1\nnew 2"}) == out
    with pytest.raises(ValueError, match="generated:y"):
        notes.replace_blocks(text, {"y": "z"})


def test_code_refs_find_every_anchor():
    assert "anchor not found" not in notes.code_refs()


def test_explainer_ledger_matches_the_seed():
    rec = explainer.evaluate({"part": "ledger", "schedule": "dense", "block_q": 2, "block_k": 2})
    assert lo.Ledger.from_dict(rec["measured"]).total == 240
    walk = explainer.evaluate({"part": "walkthrough", "query": 0, "key_tile": 4})
    assert [s["keys_seen"] for s in walk["steps"]] == [4, 6]
    assert walk["online_vs_dense"] < 1e-12 and walk["kernel_vs_dense"] < 1e-5


# --- the one command ----------------------------------------------------------------------

def test_figures_quick_end_to_end(tmp_path, capfd):
    args = ["figures", "--quick", "--no-progress", "--results-dir", str(tmp_path / "results"),
            "--figures-dir", str(tmp_path / "figures"), "--notes", str(tmp_path / "notes.md")]
    assert main(args) == 0
    for name in ("traffic", "theorem2", "explainer"):
        for ext in ("png", "pdf"):
            assert (tmp_path / "figures" / f"{name}.{ext}").stat().st_size > 1000
        data = results.load(tmp_path / "results" / f"{name}.simulator.json")
        assert data["complete"] and data["provenance"]["backend"] == "simulator"
    slopes = results.load(tmp_path / "results" / "theorem2_slopes.simulator.json")
    assert slopes["records"]
    text = (tmp_path / "notes.md").read_text()
    appendix = (tmp_path / "notes_appendix.md").read_text()  # the paper's appendix beside it
    assert "| **total (model)** | **240** |" in text
    assert "counted by the kernels, small sizes" in text and "slope ± stderr" in appendix
    assert "<!-- BEGIN generated:findings -->\n- **Counted traffic" in text
    # a second run resumes: nothing is measured again, and every file it wrote (results,
    # figures, notes) is byte for byte what it was
    def snapshot():
        return {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    first = snapshot()
    assert main(args) == 0
    assert snapshot() == first
    before = (tmp_path / "results" / "traffic.simulator.json").read_text()
    # a damaged results file ends in one clear line, status 2
    (tmp_path / "results" / "traffic.simulator.json").write_text(before[:100])
    capfd.readouterr()
    assert main(args) == 2
    err = capfd.readouterr().err
    assert "corrupt or partial" in err and err.count("\n") == 1


def test_git_sha_is_dirty_for_code_changes_only(tmp_path, monkeypatch):
    import subprocess

    from loop_orders.results import git_sha

    monkeypatch.delenv("LOOP_ORDERS_GIT_SHA", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("1")
    (tmp_path / "paper_notes.md").write_text("1")
    (tmp_path / "code.py").write_text("1")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "results" / "r.json").write_text("2")  # an experiment's output
    (tmp_path / "paper_notes.md").write_text("2")
    assert git_sha(tmp_path) == head
    (tmp_path / "code.py").write_text("2")  # the code that measures
    assert git_sha(tmp_path) == head + "-dirty"


def test_window_traffic_counts_equal_the_model_and_flash_orders_grow_with_the_window():
    """experiments/window_traffic: every order's counted traffic under a causal sliding
    window equals its model (outputs and gradients checked first); at N = 16384 the flash
    orders' traffic grows at most in proportion to the window, dense's not at all."""
    from experiments import window_traffic

    rows = window_traffic.measured_rows({"n": 16, "d": 4, "block": 4, "windows": [2]})
    assert len(rows) == 2 * len(lo.core.schedule.grad_variants(forwards=True))
    assert all(r["equal"] and r["counted"] > 0 for r in rows)
    model = window_traffic.model_rows({**window_traffic.MODEL, "windows": [512, 1024]})
    by = {(r["pass"], r["order"], r["window"]): r["bytes"] for r in model}
    for (pass_, order, w), small in by.items():
        if w == 512:
            large = by[pass_, order, 1024]
            if order == "dense":
                assert large == small
            else:
                assert small < large <= 2 * small, (pass_, order)
