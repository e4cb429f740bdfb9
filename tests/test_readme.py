"""Every snippet of the README runs as shown: its ```python blocks, and each command of its
```sh blocks (the ```bash ones are set-up and GPU commands, not run here)."""

import re
import shlex
from pathlib import Path

import pytest

from loop_orders.cli import main

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


PYTHON = blocks("python")
COMMANDS = [line for block in blocks("sh") for line in block.splitlines() if line.strip()]


def test_the_readme_has_examples_to_run():
    assert len(PYTHON) >= 2 and len(COMMANDS) >= 5


@pytest.mark.parametrize("code", PYTHON, ids=[f"python-{i}" for i in range(len(PYTHON))])
def test_python_snippet_runs(code):
    if "import torch" in code:
        pytest.importorskip("torch")
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.parametrize("command", COMMANDS, ids=[c.split()[1] + f"-{i}"
                                                   for i, c in enumerate(COMMANDS)])
def test_command_runs(command, capsys):
    argv = shlex.split(command)
    assert argv[0] == "loop-orders"
    assert main(argv[1:]) == 0, capsys.readouterr().err
