"""Tables, bars and checks list every tensor a schedule declares (issue 51): split_kv's
workspace (`o_part`, `lse_part`) must not vanish where a loop runs over the common tensors.

The figures and the table are built from the committed simulator results, so what is checked
is what `loop-orders figures` draws from them."""

import re
from collections import defaultdict

import pytest

import loop_orders as lo
from experiments import common, explainer, traffic
from loop_orders import results

RESULTS = common.REPO_ROOT / "results"
WORKSPACE = ("o_part", "lse_part")


def _context(tmp_path):
    return common.Context(results_dir=RESULTS, figures_dir=tmp_path, notes_path=tmp_path / "n.md",
                          progress=False)


def _drawn_figure(module, tmp_path, monkeypatch):
    """The figure `module.plot` draws from the committed results (not written to disk)."""
    drawn = []
    monkeypatch.setattr(common, "save_figure", lambda fig, *_: drawn.append(fig) or [])
    monkeypatch.setattr(common.runtime, "backend_name", lambda: "simulator")
    module.plot(_context(tmp_path))
    return drawn[0]


def _stacked_heights(ax) -> dict[int, float]:
    """The height of each stacked bar of `ax`, by its x position."""
    heights = defaultdict(float)
    for patch in ax.patches:
        heights[round(patch.get_x() + patch.get_width() / 2)] += patch.get_height()
    return dict(heights)


def test_split_kv_declares_its_workspace():
    assert set(WORKSPACE) <= set(lo.get_schedule("split_kv").ledger_tensors())


def test_residual_check_sees_a_workspace_tensor():
    model = lo.predict_traffic("split_kv", n=16, d=4, block_q=8, block_k=4)
    measured = model.to_dict()
    measured["o_part"] = {**measured["o_part"], "write": measured["o_part"]["write"] + 5}
    rec = {"key": {"schedule": "split_kv", "n": 16}, "model": model.to_dict(),
           "measured": measured, "backend": "simulator"}
    assert traffic.residuals([rec])[0]["max_abs"] == 5


def test_explainer_ledger_table_rows_sum_to_each_total():
    data = results.load(RESULTS / f"{explainer.NAME}.simulator.json")
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in explainer.ledger_table(data).splitlines() if line.startswith("|")]
    header, body = rows[0], {r[0]: r[1:] for r in rows[2:]}
    assert set(WORKSPACE) <= set(body)
    totals = [int(x.strip("*")) for x in body["**total (model)**"]]
    tensors = [t for t in body if not t.startswith("**") and not t.startswith("total")]
    for col, total in enumerate(totals):
        moved = sum(int(n) for t in tensors for n in re.findall(r"\d+", body[t][col]))
        assert moved == total, header[col + 1]


@pytest.mark.parametrize("module", [explainer, traffic], ids=lambda m: m.NAME)
def test_drawn_bars_reach_the_labelled_totals(module, tmp_path, monkeypatch):
    fig = _drawn_figure(module, tmp_path, monkeypatch)
    ax = fig.axes[0 if module is explainer else 1]
    labels = [t.get_text() for t in ax.texts if "model" in t.get_text()]
    labelled = [int(re.match(r"[\d,]+", t).group().replace(",", "")) for t in labels]
    drawn = _stacked_heights(ax)
    assert len(labelled) == len(drawn) == len(lo.schedule_names())
    assert [round(drawn[x]) for x in sorted(drawn)] == labelled
    assert set(WORKSPACE) <= {t.get_text() for t in ax.get_legend().get_texts()}
