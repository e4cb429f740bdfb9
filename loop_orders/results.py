"""Results files: provenance, atomic writes, resumable sweeps, and refusing damaged files.

Every experiment (traffic, Theorem 2, runtime benchmarks, ncu captures, ...) stores its points
in one JSON file under the results directory (`results/`, or `$LOOP_ORDERS_RESULTS`):

    {"format": "loop_orders.results/1", "name": "theorem2", "complete": true,
     "provenance": {...latest run...}, "runs": [{...every run that added points...}],
     "n_records": 3, "records": [{"key": {...configuration...}, "run": 0, ...values...}]}

* `provenance()` says where numbers came from: git SHA (and whether the tree was dirty),
  backend and device name, library versions, UTC date.
* `atomic_write_text` writes a temporary file beside the target and renames it over the
  target, so a reader sees the old file or the new one, never half of one.
* `Sweep` resumes: points are keyed by their configuration (a JSON object); `Sweep.run` skips
  keys already stored and saves after every new point, so an interrupted sweep loses at most
  the point in flight.
* `load` refuses a file that is not valid JSON, lacks the fields above, or whose record count
  disagrees with `n_records` (a truncated or hand-damaged file), with a `ResultsError` naming
  the file and what to do, instead of letting a plot draw from it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = "loop_orders.results/1"
ENV_RESULTS_DIR = "LOOP_ORDERS_RESULTS"
REPO_ROOT = Path(__file__).resolve().parent.parent
VERSIONED_PACKAGES = ("loop-orders", "numpy", "numba", "numba-cuda", "scipy", "matplotlib")


class ResultsError(ValueError):
    """A results file is missing, corrupt, partial or of another format."""


def results_dir(override: str | os.PathLike | None = None) -> Path:
    """Where results live: `override`, else $LOOP_ORDERS_RESULTS, else <repo>/results."""
    chosen = override or os.environ.get(ENV_RESULTS_DIR) or REPO_ROOT / "results"
    return Path(chosen)


# What the experiments write: changes there do not make the code that measured "dirty".
OUTPUTS = ("results", "figures", "paper_notes.md")


def git_sha(root: Path = REPO_ROOT) -> str:
    """HEAD's SHA, with '-dirty' when tracked files other than the experiments' outputs
    (OUTPUTS) differ from it; 'unknown' outside git.

    $LOOP_ORDERS_GIT_SHA overrides it, for a copy of the tree without .git (a GPU machine).
    """
    if os.environ.get("LOOP_ORDERS_GIT_SHA"):
        return os.environ["LOOP_ORDERS_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", *(f":(exclude){o}" for o in OUTPUTS)],
                               cwd=root, capture_output=True, text=True, check=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def provenance(**extra: Any) -> dict[str, Any]:
    """Where and when numbers were produced. `extra` adds experiment-specific fields."""
    from .device import runtime

    record = {
        "git_sha": git_sha(),
        "backend": runtime.backend_name(),
        "device": runtime.device_name(),
        "host": platform.node(),
        "versions": library_versions(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    record.update(extra)
    return record


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see old or new, never half
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


def config_key(config: Mapping[str, Any]) -> str:
    """Canonical text of a configuration: equal configurations give equal keys."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a results file; raise ResultsError naming the problem otherwise."""
    path = Path(path)
    hint = f"delete {path} and rerun the experiment that writes it"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path}: no results file; run the experiment first "
                           f"(`loop-orders figures`)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: corrupt or partial results file ({exc.msg} at line "
                           f"{exc.lineno}); {hint}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ResultsError(f"{path}: not a {FORMAT} results file (format {found!r}); {hint}")
    for field in ("name", "provenance", "runs", "records", "n_records", "complete"):
        if field not in data:
            raise ResultsError(f"{path}: results file lacks {field!r}; {hint}")
    records = data["records"]
    if not isinstance(records, list) or len(records) != data["n_records"]:
        count = len(records) if isinstance(records, list) else "no list of"
        raise ResultsError(f"{path}: partial results file: {count} records, header says "
                           f"{data['n_records']}; {hint}")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("key"), dict):
            raise ResultsError(f"{path}: record {i} has no configuration 'key'; {hint}")
    return data


class Sweep:
    """A resumable sweep stored in `<dir>/<name>.json`.

        sweep = Sweep("theorem2", results_dir())
        sweep.run(configs, evaluate)   # evaluate(config) -> dict of values; skips done keys
        sweep.finish()                 # marks the file complete
        sweep.records()                # [{"key": config, ...values...}, ...]

    `meta` (any JSON object, e.g. the sweep's declaration) is stored in the file; a stored file
    whose meta differs is refused rather than mixed with new points, unless `fresh=True`.
    """

    def __init__(self, name: str, directory: str | os.PathLike | None = None, *,
                 meta: Mapping[str, Any] | None = None, fresh: bool = False,
                 provenance_fn: Callable[[], dict[str, Any]] = provenance):
        self.name = name
        self.path = results_dir(directory) / f"{name}.json"
        self.meta = dict(meta or {})
        self._provenance_fn = provenance_fn
        self._run_index: int | None = None
        if self.path.exists() and not fresh:
            self.data = load(self.path)
            if self.data["name"] != name:
                raise ResultsError(f"{self.path}: holds sweep {self.data['name']!r}, "
                                   f"expected {name!r}")
            if self.data.get("meta", {}) != json.loads(json.dumps(self.meta)):
                raise ResultsError(f"{self.path}: was written by a different sweep "
                                   f"declaration; delete it (or pass fresh) to start over")
        else:
            self.data = {"format": FORMAT, "name": name, "complete": False, "meta": self.meta,
                         "provenance": {}, "runs": [], "n_records": 0, "records": []}
        self._index = {config_key(r["key"]): r for r in self.data["records"]}

    def done(self, config: Mapping[str, Any]) -> bool:
        return config_key(config) in self._index

    def get(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        return self._index.get(config_key(config))

    def records(self) -> list[dict[str, Any]]:
        return list(self.data["records"])

    def pending(self, configs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [dict(c) for c in configs if not self.done(c)]

    def _start_run(self) -> int:
        if self._run_index is None:
            prov = self._provenance_fn()
            self.data["runs"].append(prov)
            self.data["provenance"] = prov
            self._run_index = len(self.data["runs"]) - 1
        return self._run_index

    def add(self, config: Mapping[str, Any], values: Mapping[str, Any], *,
            save: bool = True) -> dict[str, Any]:
        key = json.loads(json.dumps(dict(config)))  # stored exactly as it will be read back
        if config_key(key) in self._index:
            raise ValueError(f"{self.name}: point {config_key(key)} is already stored")
        record = {"key": key, "run": self._start_run(), **values}
        self.data["records"].append(record)
        self.data["n_records"] = len(self.data["records"])
        self.data["complete"] = False
        self._index[config_key(key)] = record
        if save:
            self.save()
        return record

    def run(self, configs: Iterable[Mapping[str, Any]],
            evaluate: Callable[[dict[str, Any]], Mapping[str, Any]], *,
            progress: bool = True, desc: str | None = None) -> list[dict[str, Any]]:
        """Evaluate every configuration not yet stored, saving after each one."""
        todo = self.pending(configs)
        if todo:
            bar = todo
            if progress:
                from tqdm import tqdm

                bar = tqdm(todo, desc=desc or self.name, unit="pt", leave=False)
            for config in bar:
                self.add(config, evaluate(config))
        return self.records()

    def finish(self) -> Path:
        self.data["complete"] = True
        return self.save()

    def save(self) -> Path:
        return atomic_write_json(self.path, self.data)
