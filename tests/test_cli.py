import json

import pytest
from conftest import SCHEDULES

import loop_orders as lo
from loop_orders.cli import main
from loop_orders.ledger import TENSORS


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
    assert list(record) == ["schedule", "n", "d", "dv", "batch", "heads", "block_q", "block_k",
                            "causal", "save_lse", "model", "measured", "backend"]
    assert record["schedule"] == schedule and record["causal"] is True
    assert list(record["model"]) == list(TENSORS)
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
