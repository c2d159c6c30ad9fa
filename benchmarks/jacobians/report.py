"""Markdown report of the benchmark results: tables of times, ratios and targets.

Rows are (configuration, allocator setting); the targets are checked per setting.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics

from allocator import ALLOCATORS, describe
from methods import JACOBIAN_METHODS, TORCH_FUNC_METHODS

BASELINE = "lt_BackPackGGN"
#: Tolerance of the float32 Jacobians against the float64 reference.
J_TOLERANCE = 1e-4


#: The setting of results written before it was recorded.
UNRECORDED = "not recorded"


def allocator_of(res: dict) -> str:
    """The allocator setting a result was measured under."""
    return res.get("allocator", UNRECORDED)


def machine_description(
    when: datetime.datetime | None = None, results: list[dict] | None = None
) -> list[str]:
    """CPU, device, library versions, date and allocator settings, one bullet each."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    results = results or []
    devices = sorted({r.get("device", "cpu") for r in results} or {"cpu"})
    gpus = [d for d in devices if d.startswith("cuda")]
    names = (
        f" ({torch.cuda.get_device_name(gpus[0])})"
        if gpus and torch.cuda.is_available()
        else ""
    )
    found = {allocator_of(r) for r in results}
    settings = [a for a in (*ALLOCATORS, UNRECORDED) if a in found]
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores, torch threads: "
        f"{torch.get_num_threads()}",
        f"- device: {', '.join(devices)}{names}",
        f"- torch {torch.__version__}, laplace-torch {version('laplace-torch')}, "
        f"backpack-for-pytorch {version('backpack-for-pytorch')}, "
        f"Python {platform.python_version()}",
        f"- date: {(when or datetime.datetime.now()).isoformat(timespec='minutes')}",
        "- CPU allocator settings (the `allocator` column; each measured in "
        "processes of its own): "
        + "; ".join(
            f"`{a}`: {describe(a) if a != UNRECORDED else 'not recorded'}"
            for a in settings
        ),
    ]


def passes(res: dict) -> bool:
    """A Jacobian result is correct if it ran and J is within float32 tolerance."""
    if not res.get("ok"):
        return False
    err = res.get("rel_err_J", res.get("rel_err_K"))
    return err is not None and err < J_TOLERANCE


def _ms(t: float | None) -> str:
    return "–" if t is None else f"{1e3 * t:.1f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 1e-9:
        return None
    return a / b


def _fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}×"


def _by(results: list[dict], task: str) -> dict[tuple[str, str], dict[str, dict]]:
    """``(configuration, allocator setting) -> method -> result`` of one task."""
    table: dict[tuple[str, str], dict[str, dict]] = {}
    for res in results:
        if res["task"] == task:
            row = (res["config"], allocator_of(res))
            table.setdefault(row, {})[res["method"]] = res
    return table


def _get(res: dict | None, key: str) -> float | None:
    if res is None or not res.get("ok"):
        return None
    return res.get(key)


def jacobian_tables(results: list[dict]) -> tuple[list[str], dict]:
    """Headline table, detail table and the per-config speed-ups for the targets."""
    table = _by(results, "jacobian")
    methods = [m for m in JACOBIAN_METHODS if any(m in r for r in table.values())]
    head = ["config", "allocator", "P", "obj."] + methods
    lines = [
        "### Headline: Jacobian part of the full step, ms (speed-up vs "
        f"`{BASELINE}` / vs fastest torch.func route)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    speed: dict[str, dict[str, dict[str, list[float]]]] = {}
    for (cfg, allocator), row in table.items():
        setting = speed.setdefault(allocator, {})
        any_res = next(iter(row.values()))
        base = _get(row.get(BASELINE), "t_jac_part")
        func = [
            _get(row.get(m), "t_jac_part")
            for m in TORCH_FUNC_METHODS
            if _get(row.get(m), "t_jac_part") is not None
        ]
        fastest_func = min(func) if func else None
        cells = [cfg, allocator, str(any_res.get("n_params", "–"))]
        cells.append(any_res.get("objective", "–"))
        for m in methods:
            t = _get(row.get(m), "t_jac_part")
            r_base, r_func = _ratio(base, t), _ratio(fastest_func, t)
            cells.append(f"{_ms(t)} ({_fmt_ratio(r_base)} / {_fmt_ratio(r_func)})")
            for key, val in (("vs_base", r_base), ("vs_func", r_func)):
                if val is not None:
                    setting.setdefault(m, {}).setdefault(key, []).append(val)
            vmap = _get(row.get("vmap_jacrev"), "t_jac_part")
            if t is not None and vmap is not None and t > 1e-9:
                setting.setdefault(m, {}).setdefault("vs_vmap", []).append(vmap / t)
            mem = [_get(row.get(k), "peak_mib") for k in (BASELINE, "vmap_jacrev")]
            mem = [v for v in mem if v is not None]
            peak = _get(row.get(m), "peak_mib")
            if mem and peak is not None and min(mem) > 0:
                setting.setdefault(m, {}).setdefault("mem", []).append(peak / min(mem))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for allocator, setting in speed.items():
        lines += [_median_row(setting, methods, allocator, len(speed) > 1), ""]
    lines += _detail_table(table, methods)
    return lines, speed


def _median_row(speed: dict, methods: list[str], allocator: str, several: bool) -> str:
    parts = []
    for m in methods:
        s = speed.get(m, {})
        vb = s.get("vs_base", [])
        vf = s.get("vs_func", [])
        if vb and vf:
            parts.append(
                f"`{m}` {statistics.median(vb):.2f}× / {statistics.median(vf):.2f}×"
            )
    where = f" (allocator `{allocator}`)" if several else ""
    return (
        f"Median speed-up over configs{where} (vs baseline / vs fastest torch.func): "
        + "; ".join(parts)
    )


def _detail_table(table: dict, methods: list[str]) -> list[str]:
    head = [
        "config",
        "allocator",
        "method",
        "J (ms)",
        "J ratio vs BP",
        "full (ms)",
        "objective (ms)",
        "Jac part (ms)",
        "peak MiB",
        "mem ratio",
        "rel err J",
        "rel err ∇x",
        "correct",
    ]
    lines = [
        "### All figures",
        "",
        "J: Jacobians alone (`enable_backprop=True`). full: Jacobians + gradient of "
        "the objective w.r.t. x. Jac part = full − objective alone. peak: resident "
        "high-water mark of the full step over the baseline after imports and model "
        "construction, fresh process (on a GPU: the CUDA allocator's peak of "
        "allocated tensors over the baseline). mem ratio: peak / min(peak of "
        f"`{BASELINE}`, peak of `vmap_jacrev`). Errors: max abs error / max abs value "
        "against float64 per-sample `vmap(jacrev)`.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for (cfg, allocator), row in table.items():
        base = _get(row.get(BASELINE), "t_jac")
        mem = [_get(row.get(k), "peak_mib") for k in (BASELINE, "vmap_jacrev")]
        mem = [v for v in mem if v is not None]
        for m in methods:
            res = row.get(m)
            if res is None:
                continue
            if not res.get("ok"):
                lines.append(
                    f"| {cfg} | {allocator} | {m} | failed: "
                    f"{res.get('error', '?')[:80]} |" + " |" * (len(head) - 4)
                )
                continue
            peak = res["peak_mib"]
            cells = [
                cfg,
                allocator,
                m,
                _ms(res["t_jac"]),
                _fmt_ratio(_ratio(base, res["t_jac"])),
                _ms(res["t_full"]),
                _ms(res["t_obj"]),
                _ms(res["t_jac_part"]),
                f"{peak:.0f}",
                _fmt_ratio(peak / min(mem)) if mem and min(mem) > 0 else "–",
                f"{res['rel_err_J']:.1e}",
                f"{res['rel_err_grad_x']:.1e}",
                "yes" if passes(res) else "NO",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def gram_table(results: list[dict]) -> tuple[list[str], dict]:
    """Gram routes side by side, with the structured speed-up over forming J."""
    table = _by(results, "gram")
    head = [
        "config",
        "allocator",
        "P",
        "route",
        "Gram (ms)",
        "Gram + ∇x (ms)",
        "speed-up vs J",
        "peak MiB",
        "rel err K",
        "correct",
    ]
    lines = [
        "### NTK Gram `K (B, B, C, C)`: structured vs forming J",
        "",
        "J: DiffBackPackGGN Jacobians + `einsum('bcp,dep->bdce')`. structured: "
        "`laplace_diffjac.kernels` (per-layer input and output-gradient "
        "Grams, no J). kernel: `laplace_diffjac.kernels.ntk`. Gram + ∇x: Gram and "
        "the gradient of its trace w.r.t. x; peak memory of that step.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    speed: dict[tuple[str, str], float] = {}
    for (cfg, allocator), row in table.items():
        t_j = _get(row.get("J"), "t_gram")
        for route, res in row.items():
            if not res.get("ok"):
                lines.append(
                    f"| {cfg} | {allocator} | – | {route} | failed: "
                    f"{res.get('error', '?')[:80]} |" + " |" * (len(head) - 5)
                )
                continue
            r = _ratio(t_j, res["t_gram"])
            if route == "structured" and r is not None:
                speed[(cfg, allocator)] = r
            cells = [
                cfg,
                allocator,
                str(res["n_params"]),
                route,
                _ms(res["t_gram"]),
                _ms(res["t_full"]),
                _fmt_ratio(r),
                f"{res['peak_mib']:.0f}",
                f"{res['rel_err_K']:.1e}",
                "yes" if passes(res) else "NO",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines, speed


def target_lines(speed: dict, gram_speed: dict) -> list[str]:
    """The issue's targets, checked on this run's numbers, per allocator setting."""
    found = set(speed) | {a for _, a in gram_speed}
    settings = [a for a in (*ALLOCATORS, UNRECORDED) if a in found]
    if not settings:
        return _targets({}, {}, "")
    lines: list[str] = []
    for allocator in settings:
        big = {c: v for (c, a), v in gram_speed.items() if a == allocator}
        where = f" (allocator `{allocator}`)" if len(settings) > 1 else ""
        lines += [*_targets(speed.get(allocator, {}), big, where), ""]
    return lines[:-1]


def _targets(speed: dict, gram_speed: dict, where: str) -> list[str]:
    """The targets table of one allocator setting."""

    def stat(m: str, key: str, fn) -> float | None:
        vals = speed.get(m, {}).get(key, [])
        return fn(vals) if vals else None

    med, lo, hi = statistics.median, min, max
    dbp, dfg = "DiffBackPackGGN", "DiffFuncGGN"
    checks = [
        (f"{dbp} ≥ 3× {BASELINE} (median)", stat(dbp, "vs_base", med), 3.0, ">="),
        (f"{dbp} ≥ 1× vmap_jacrev (min)", stat(dbp, "vs_vmap", lo), 1.0, ">="),
        (f"{dbp} ≥ 1.2× vmap_jacrev (median)", stat(dbp, "vs_vmap", med), 1.2, ">="),
        (f"{dfg} ≥ 1× vmap_jacrev (min)", stat(dfg, "vs_vmap", lo), 1.0, ">="),
        (f"{dbp} peak ≤ 1.1 × min(BP, vmap) (max)", stat(dbp, "mem", hi), 1.1, "<="),
        (f"{dfg} peak ≤ 1.1 × min(BP, vmap) (max)", stat(dfg, "mem", hi), 1.1, "<="),
    ]  # fmt: skip
    big = [v for k, v in gram_speed.items() if k.startswith("mlp2x512-C1-B256")]
    target = "structured Gram ≥ 5× J route, width 512, B 256"
    checks.append((target, big[0] if big else None, 5.0, ">="))
    lines = [f"### Targets{where}", "", "| target | measured | met |", "|---|---|---|"]
    for name, val, bound, op in checks:
        if val is None:
            lines.append(f"| {name} | – | not measured |")
            continue
        ok = val >= bound if op == ">=" else val <= bound
        lines.append(f"| {name} | {val:.2f} | {'yes' if ok else 'no'} |")
    return lines


def write_report(
    results: list[dict],
    path: str,
    *,
    quick: bool,
    notes: list[str],
    wall_s: float | None,
    when: datetime.datetime | None = None,
) -> None:
    """Write the Markdown report of one benchmark run to ``path``.

    ``wall_s=None`` and ``when`` render saved results again (``--report-from``).
    """
    for res in results:
        if res.get("t_full") is not None and res.get("t_obj") is not None:
            diff = res["t_full"] - res["t_obj"]
            res["t_jac_part"] = diff if diff > 0 else None
    jac_lines, speed = jacobian_tables(results)
    gram_lines, gram_speed = gram_table(results)
    processes = max((r.get("timing_processes", 1) for r in results), default=1)
    mode = "quick (smoke sizes; timings meaningless)" if quick else "full"
    lines = [
        "# laplace_diffjac benchmarks",
        "",
        "Generated by `python benchmarks/jacobians/run.py"
        + (" --quick" if quick else "")
        + "` "
        + (
            f"({mode}, {wall_s:.0f} s wall)."
            if wall_s is not None
            else f"({mode}), rendered again from its saved results."
        ),
        "",
        *machine_description(when, results),
        "",
        "Peak memory and errors: each (configuration, method) ran in its own "
        "fresh process (quick mode: one process per configuration). Times: all "
        "methods of a configuration in one process, run in turn round after round "
        "(each round starting from another method) so that slow spells of the "
        "machine fall on all of them; medians of 3 to 15 runs (one in quick mode), "
        "the objective alone timed in the same rounds; each time is the median "
        f"over {processes} such process(es) per configuration, spread over the "
        "run. Speed-up = other time / this time (> 1: faster). Objective of the "
        "full step: `logdet` = logdet(I + J Jᵀ) on the (B·C)² Gram where "
        "(B·C)²·P ≤ 1e9; otherwise "
        "`trace` = tr(J Jᵀ) = ‖J‖²_F, so that the objective's own cost stays "
        "small next to the Jacobians. A Jacobian part shown as – failed, or "
        "measured no longer than the objective alone (noise).",
        "",
        *[f"- Note: {n}" for n in notes],
        "",
        *target_lines(speed, gram_speed),
        "",
        *jac_lines,
        "",
        *gram_lines,
        "",
    ]
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
