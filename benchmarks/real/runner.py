"""Run the study: (data set, seed) tasks, in up to ``workers`` processes."""

from __future__ import annotations

import json
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
from .training import TrainConfig

__all__ = ["run_study", "run_task"]


def run_task(
    name: str,
    seed: int,
    config: StudyConfig,
    train: TrainConfig,
    raw_dir: str,
    on_method: Callable[[str], None] | None = None,
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

    Returns
    -------
    list of dict

    """
    torch.set_num_threads(1)
    start, cpu = time.perf_counter(), time.process_time()
    split = load_split(name, seed)
    ctx = build_context(split, seed, train)
    if on_method is not None:
        on_method(f"{name} seed {seed}: network and full Laplace ready")
    rows = evaluate_seed(ctx, config, on_method)
    for row in rows:
        row.update(dataset=name, seed=seed, task=split.task)
        row.setdefault("train_s", ctx.times["train"])
    meta = {
        "dataset": name,
        "seed": seed,
        "n_train": int(split.x_train.shape[0]),
        "n_params": ctx.full.n_params,
        "sigma_noise": ctx.sigma_noise,
        "times": ctx.times,
        "total_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,  # one thread: the unshared wall time
    }
    Path(raw_dir, f"{name}_{seed}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    return rows


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
        What to run.
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
        The raw task records ``{"meta": ..., "rows": ...}``.

    """
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    # the largest data set first, so that two workers finish together
    tasks = [(d, s) for d in datasets for s in seeds]
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
            futures = {pool.submit(run_task, *a): a for a in args}
            for fut in as_completed(futures):
                fut.result()
                bar.set_postfix_str(f"done {futures[fut][0]} seed {futures[fut][1]}")
                bar.update()
    bar.close()
    records = [json.loads((raw / f"{d}_{s}.json").read_text()) for d, s in tasks]
    (out / "config.json").write_text(
        json.dumps({"study": asdict(config), "train": asdict(train)}, indent=1)
    )
    return records
