"""Run the study: (data set, seed) tasks, in up to ``workers`` processes.

Rows are written as they come: ``raw/<data set>_<seed>.partial.json`` after every
method, ``raw/<data set>_<seed>.json`` when the task is done (the partial file is
then removed), so a run cut short keeps what it had (:func:`load_records`).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from .context import build_context
from .data import load_split
from .evaluate import StudyConfig, evaluate_seed
from .probes import make_probe, part_split
from .training import TrainConfig

__all__ = ["load_records", "run_study", "run_task", "task_order"]


def _log_line(name: str, seed: int, start: float) -> Callable[[str], None]:
    def log(label: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        elapsed = time.perf_counter() - start
        print(f"[{stamp}] {name} seed {seed} +{elapsed:.0f}s: {label}", flush=True)

    return log


def run_task(
    name: str,
    seed: int,
    config: StudyConfig,
    train: TrainConfig,
    raw_dir: str,
    on_method: Callable[[str], None] | None = None,
    log: bool = False,
) -> list[dict[str, Any]]:
    """All rows of one (data set, seed), written to ``raw_dir/name_seed.json``.

    Parameters
    ----------
    name : str
        Data set.
    seed : int
        Seed.
    config : StudyConfig
        Study sizes.
    train : TrainConfig
        MAP training.
    raw_dir : str
        Folder for the per-task JSON.
    on_method : callable, optional
        Progress callback, called with a label after each step.
    log : bool, default=False
        Print a time-stamped line after each step (used by worker processes).

    Returns
    -------
    list of dict

    """
    torch.set_num_threads(1)
    start, cpu = time.perf_counter(), time.process_time()
    if log and on_method is None:
        on_method = _log_line(name, seed, start)
    main = config.part == "main"
    split = load_split(name, seed) if main else part_split(name, seed, config.part)
    ctx = build_context(split, seed, train)
    start_probe = time.perf_counter()
    probe = None if main else make_probe(ctx, config.part)
    ctx.times["probe_sets"] = time.perf_counter() - start_probe
    meta: dict[str, Any] = {
        "dataset": name,
        "seed": seed,
        "n_train": int(split.x_train.shape[0]),
        "n_params": ctx.full.n_params,
        "sigma_noise": ctx.sigma_noise,
        "times": ctx.times,
    }
    partial = Path(raw_dir, f"{name}_{seed}.partial.json")

    def tag(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in rows:
            row.update(dataset=name, seed=seed, task=split.task)
            row.setdefault("train_s", ctx.times["train"])
        return rows

    def write_partial(rows: list[dict[str, Any]]) -> None:
        now = {"total_s": time.perf_counter() - start, "partial": True}
        record = {"meta": {**meta, **now}, "rows": tag(rows)}
        partial.write_text(json.dumps(record, indent=1))

    if on_method is not None:
        on_method("network and full Laplace ready")
    rows = tag(evaluate_seed(ctx, config, on_method, write_partial, probe))
    meta["total_s"] = time.perf_counter() - start
    meta["cpu_s"] = time.process_time() - cpu  # one thread: the unshared wall time
    Path(raw_dir, f"{name}_{seed}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    partial.unlink(missing_ok=True)
    return rows


def load_records(raw: Path, tasks: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Finished task records, else partial ones, for the tasks that have either.

    Parameters
    ----------
    raw : Path
        The ``raw`` folder.
    tasks : list of (str, int)
        (data set, seed) pairs.

    Returns
    -------
    list of dict
        ``{"meta": ..., "rows": ...}``; a partial record has ``meta["partial"]``.

    """
    records = []
    for d, s in tasks:
        for path in (raw / f"{d}_{s}.json", raw / f"{d}_{s}.partial.json"):
            if path.exists():
                records.append(json.loads(path.read_text()))
                break
    return records


def task_order(datasets: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """The order tasks are started in: useful results early in a run cut short.

    The first seed of every data set, then the remaining seeds of all data sets but
    the first (the small ones), then the first data set's (the largest's) remaining
    seeds. On 2 workers one works through the large data set while the other does
    the small ones, so a run cut short has every data set, most with all seeds.

    Parameters
    ----------
    datasets : list of str
        Largest first.
    seeds : list of int
        Seeds.

    Returns
    -------
    list of (str, int)

    """
    first = [(d, seeds[0]) for d in datasets]
    small = [(d, s) for s in seeds[1:] for d in datasets[1:]]
    return first + small + [(datasets[0], s) for s in seeds[1:]]


def run_study(
    datasets: list[str],
    seeds: list[int],
    config: StudyConfig,
    train: TrainConfig,
    out: Path,
    workers: int = 2,
    resume: bool = False,
) -> list[dict[str, Any]]:
    """Every (data set, seed) task; finished tasks are kept in ``out/raw``.

    Parameters
    ----------
    datasets, seeds : list
        What to run (largest data set first; order: :func:`task_order`).
    config : StudyConfig
        Study sizes.
    train : TrainConfig
        MAP training.
    out : Path
        Output folder.
    workers : int, default=2
        Processes (each with one torch thread); ``1`` runs in this process.
    resume : bool, default=False
        Reuse ``out/raw/<data set>_<seed>.json`` of finished tasks.

    Returns
    -------
    list of dict
        The task records ``{"meta": ..., "rows": ...}`` (partial ones for tasks
        that failed part-way; a failed task is reported on stderr).

    """
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps({"study": asdict(config), "train": asdict(train)}, indent=1)
    )
    tasks = task_order(datasets, seeds)
    todo = [t for t in tasks if not (resume and (raw / f"{t[0]}_{t[1]}.json").exists())]
    bar = tqdm(total=len(tasks), initial=len(tasks) - len(todo), desc="study")
    args = [(d, s, config, train, str(raw)) for d, s in todo]
    if workers <= 1:
        for a in args:
            bar.set_postfix_str(f"{a[0]} seed {a[1]}")
            run_task(*a, on_method=bar.set_postfix_str)
            bar.update()
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(run_task, *a, None, True): a for a in args}
            for fut in as_completed(futures):
                name, seed = futures[fut][:2]
                try:
                    fut.result()
                except Exception as err:  # keep the other tasks and the partial rows
                    print(f"task {name} seed {seed} failed: {err!r}", file=sys.stderr)
                bar.set_postfix_str(f"done {name} seed {seed}")
                bar.update()
    bar.close()
    return load_records(raw, tasks)
