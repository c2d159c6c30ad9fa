"""Everything a lent GPU should run, in under 8 minutes: ``python run_on_gpu.py OUT``.

Run from anywhere with the repository checked out, ideally right after the machine
starts (``OUT`` is where the results go, e.g. ``$OUT`` of a device run):

1. **Environment** (at most 20 s): Python, torch, CUDA, ``nvidia-smi``.
2. **Set-up**, only if this interpreter cannot import the package's test
   dependencies: ``.venv`` in the repository root (made with
   ``--system-site-packages``, so that a CUDA build of torch already on the
   machine is used, not downloaded) and ``pip install -e ".[test]"`` into it
   (``--find-links DIR`` for a wheelhouse on a machine without network;
   ``--no-install`` to skip). Its time counts against the budget.
3. **Device tests** (at most 120 s): ``tests/test_devices.py``, every test that
   takes a ``device`` (CPU, and CUDA when torch sees a GPU), JUnit XML in
   ``OUT/tests.xml``.
4. **NTK within the memory budget** (at most 120 s): ``ntk_budget.py`` on
   ResNet-18 with the CIFAR stem, B = 16 and 64: ``OUT/ntk_budget.json``,
   ``OUT/NTK_BUDGET.md``.
5. **The context posterior and the location step at real size** (issue #42), each
   its own step, each row its own process, under the GPU's default memory budget
   (``benchmarks/context_posterior/context_budget.py``, ResNet-18 with the CIFAR
   stem): ``context:fit`` (at most 160 s), M = 64, N = 2,000, float64 and float32
   (the float32 error against float64: the compute dtype's measurement),
   ``OUT/CONTEXT_FIT.md``; ``context:step`` (at most 100 s), ``optimize_locations``
   with M = 100, N = 10,000, minibatches of 256, ``OUT/CONTEXT_STEP.md``;
   ``context:large`` (at most 200 s), M = 256, N = 10,000, float64,
   ``OUT/CONTEXT_LARGE.md``. Each writes its JSON after every row. In the dry
   run the step and the large fit run without a budget and under two small ones
   instead (the plans that chunk at smoke size).
6. **NTK routes** (at most 110 s): ``benchmarks/jacobians/ntk_routes.py`` at its
   recorded sizes, 3 interleaved rounds, with FLOPs: ``OUT/ntk_routes.json``,
   ``OUT/NTK_ROUTES.md``.
7. **Jacobian benchmark rows** (at most 170 s): ``benchmarks/jacobians/run.py`` at
   the README's headline configurations (MLP 2×256, C=10, B=128; CNN, C=10, B=32;
   the structured Gram of a width-512 MLP at B=256), every route, one timing
   process, on the device: ``OUT/RESULTS.md``, ``OUT/results.json``.

The real-size rows come first, the rows an earlier GPU run recorded last: within
the budget the last steps may be cut off or skipped.

Every step runs in a subprocess with a hard time limit, the smaller of its own
and what is left of ``--budget`` (default 450 s, leaving half a minute of the 8
for starting Python and copying files); a step that fails or runs out of time is
recorded and the next one runs. ``OUT/GPU.md`` summarises the steps, the test
counts and the headline tables; ``OUT/gpu_run.json`` holds the same as data;
``OUT/logs/`` each step's output. Exit status 0 when every step passed.

``--device cpu --quick`` is the dry run of the same steps on the CPU, at smoke
sizes (``tests/test_gpu_script.py`` runs it); ``--quick`` alone shrinks the
benchmarks on the GPU too. This script needs only the standard library; each
step runs with the repository root on ``PYTHONPATH``, so it measures this
checkout whatever is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[2]
JACOBIANS = ROOT / "benchmarks" / "jacobians"
CONTEXT_BUDGET = ROOT / "benchmarks" / "context_posterior" / "context_budget.py"

#: The README's headline rows of ``run.py`` (Jacobians, and the structured Gram).
HEADLINE_CONFIGS = ["mlp2x256-C10-B128", "cnn-w64-C10-B32", "mlp2x512-C1-B256"]
#: The smoke-size stand-ins of ``--quick`` (``cases.QUICK``/``GRAM_QUICK``).
QUICK_CONFIGS = ["mlp2x16-C3-B8"]
QUICK_METHODS = ["vmap_jacrev", "DiffBackPackGGN"]

#: Hard limit of each step, seconds (the budget may cut it shorter).
LIMITS = {
    "environment": 20,
    "setup": 240,
    "tests": 120,
    "jacobians": 170,
    "ntk": 110,
    "route_costs": 60,
    "ntk_budget": 120,
    "context:fit": 160,
    "context:step": 100,
    "context:large": 200,
}

#: What a working interpreter imports (the tests' and benchmarks' dependencies).
NEEDED = "import torch, laplace, backpack, curvlinops, pytest, laplace_diffjac"


@dataclass
class Step:
    """One step's outcome."""

    name: str
    command: list[str]
    limit_s: float
    returncode: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    log: str = ""
    notes: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class Runner:
    """Runs the steps in order within one time budget, logging each."""

    def __init__(self, out: pathlib.Path, budget_s: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.steps: list[Step] = []
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], env: dict | None = None) -> Step:
        """Run ``command`` from the repository root, its output in ``logs/``."""
        key = name if name in LIMITS else name.split(":")[0]  # setup:pip: setup
        limit = max(0.0, min(LIMITS[key], self.left()))
        step = Step(name, [str(c) for c in command], round(limit, 1))
        step.log = f"logs/{name.replace(':', '-')}.log"
        self.steps.append(step)
        if limit < 5:
            step.notes["skipped"] = "no time left in the budget"
            return step
        start = time.monotonic()
        with open(self.out / step.log, "w") as log:
            try:
                proc = subprocess.run(
                    step.command,
                    cwd=ROOT,
                    env=env or child_environment(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=limit,
                    check=False,
                )
                step.returncode = proc.returncode
            except subprocess.TimeoutExpired:
                step.timed_out = True
        step.seconds = round(time.monotonic() - start, 1)
        print(f"{name}: {'ok' if step.ok else 'FAILED'} ({step.seconds} s)", flush=True)
        return step


def child_environment() -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}


def _works(python: str) -> bool:
    proc = subprocess.run(
        [python, "-c", NEEDED],
        cwd=ROOT,
        env=child_environment(),
        capture_output=True,
        timeout=120,
        check=False,
    )
    return proc.returncode == 0


def interpreter(runner: Runner, install: bool, find_links: str | None) -> str | None:
    """A Python that imports what the steps need; installs it if allowed."""
    venv = ROOT / ".venv" / "bin" / "python"
    for python in (sys.executable, str(venv)):
        if pathlib.Path(python).exists() and _works(python):
            return python
    if not install:
        return None
    if not venv.exists():
        made = runner.run(
            "setup:venv",
            [sys.executable, "-m", "venv", "--system-site-packages", ROOT / ".venv"],
        )
        if not made.ok:
            return None
    pip = [str(venv), "-m", "pip", "install", "-e", ".[test]"]
    pip += ["--find-links", find_links] if find_links else []
    runner.run("setup:pip", pip)
    return str(venv) if _works(str(venv)) else None


def environment(runner: Runner, python: str, device: str) -> None:
    """Record the interpreter, torch, CUDA and the GPU (``nvidia-smi``)."""
    probe = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available(), "
        "'gpus': [torch.cuda.get_device_name(i) for i in "
        "range(torch.cuda.device_count())]}))"
    )
    step = runner.run("environment", [python, "-c", probe])
    log = (runner.out / step.log).read_text().strip().splitlines()
    found = [json.loads(line) for line in log if line.startswith("{")]
    step.notes.update(found[-1] if found else {})
    step.notes["python"] = python
    step.notes["platform"] = platform.platform()
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,memory.total,driver_version"
        smi = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        step.notes["nvidia-smi"] = smi.stdout.strip()
    if device.startswith("cuda") and not step.notes.get("cuda_available"):
        step.notes["error"] = "torch sees no CUDA device"
        step.returncode = step.returncode or 1


def test_counts(path: pathlib.Path) -> dict[str, int]:
    """Tests, failures, errors and skips of a JUnit XML file."""
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    keys = ("tests", "failures", "errors", "skipped")
    return {k: int(suite.get(k, 0)) for k in keys}


def steps(runner: Runner, python: str, device: str, quick: bool) -> None:
    """The tests and the benchmark rows, in order."""
    out = runner.out
    tests = runner.run(
        "tests",
        [python, "-m", "pytest", "tests/test_devices.py", "-q", "-p"]
        + ["no:cacheprovider", f"--junitxml={out / 'tests.xml'}"],
    )
    tests.notes.update(test_counts(out / "tests.xml"))
    # ResNet-18 (CIFAR stem) ntk + d/dx within the memory budget, each row its
    # own process
    # (quick: the rows tests/test_gpu_script.py checks, ntk_budget.py's own test)
    sizes = ["--quick", "--batch", "8"] if quick else []
    sizes = sizes or ["--model", "resnet18-cifar", "--batch", "16", "64"]
    sizes += [] if quick else ["--jacobian-batch", "16"]
    runner.run(
        "ntk_budget",
        [python, JACOBIANS / "ntk_budget.py", "--device", device, *sizes]
        + ["--out", out / "ntk_budget.json", "--markdown", out / "NTK_BUDGET.md"],
    )
    context_steps(runner, python, device, quick)
    # (quick: two allocator settings, the rows ntk_routes.py's test checks)
    rounds = ["--repeats", "3"]
    if quick:
        rounds = ["--quick", "--repeats", "1", "--allocator", "default", "mmap-off"]
    runner.run(
        "ntk",
        [python, JACOBIANS / "ntk_routes.py", "--device", device, *rounds]
        + ["--out", out / "ntk_routes.json", "--markdown", out / "NTK_ROUTES.md"],
    )
    # the route choice's constants, fitted on this device (issue #42, item 3)
    runner.run(
        "route_costs",
        [python, JACOBIANS / "route_costs.py", "--device", device]
        + (["--quick"] if quick else ["--rounds", "5"])
        + ["--out", out / "route_costs.json", "--markdown", out / "ROUTE_COSTS.md"],
    )
    if quick:
        configs, extra = QUICK_CONFIGS, ["--quick", "--methods", *QUICK_METHODS]
    else:
        # correctness and memory 4 processes at a time; timings one at a time
        configs = HEADLINE_CONFIGS
        extra = ["--repeats", "1", "--jobs", "4", "--timing-jobs", "1"]
    runner.run(
        "jacobians",
        [python, JACOBIANS / "run.py", "--device", device, "--configs", *configs]
        + [*extra, "--timeout", "100", "--out", out / "RESULTS.md"]
        + ["--json", out / "results.json"],
    )


#: The context rows (issue #42, item 5): step name, output stem, arguments at
#: real size (the device's default budget), and at the smoke size of ``--quick``,
#: where the step and the large fit run the budgets that chunk at that size
#: (none, one too small for a step that recomputes a fit's locations, one that
#: holds them), so that the dry run checks those plans too.
SMALL_BUDGETS = ["--budgets", "none", "640 KiB", "2.25 MiB"]
CONTEXT_ROWS = [
    (
        "context:fit",
        "context_fit",
        ["--paths", "fit", "--locations", "64", "--n-data", "2000"]
        + ["--dtypes", "float64", "float32", "--budgets", "default"],
        ["--paths", "fit", "--dtypes", "float64", "float32", "--budgets", "default"],
    ),
    (
        "context:step",
        "context_step",
        ["--paths", "step", "--step-locations", "100", "--step-data", "10000"]
        + ["--minibatch", "256", "--budgets", "default"],
        ["--paths", "step", *SMALL_BUDGETS],
    ),
    (
        "context:large",
        "context_large",
        ["--paths", "fit", "--locations", "256", "--n-data", "10000"]
        + ["--budgets", "default"],
        ["--paths", "fit", *SMALL_BUDGETS],
    ),
]


def context_steps(runner: Runner, python: str, device: str, quick: bool) -> None:
    """The context posterior's and the location step's real-size rows, each step
    its own ``context_budget.py`` run (its budgets in :data:`CONTEXT_ROWS`)."""
    model = ["--quick"] if quick else ["--model", "resnet18-cifar"]
    for name, stem, sizes, quick_sizes in CONTEXT_ROWS:
        limit = LIMITS[name]
        runner.run(
            name,
            [python, CONTEXT_BUDGET, "--device", device, *model]
            + (quick_sizes if quick else sizes)
            + ["--timeout", str(limit)]
            + ["--out", runner.out / f"{stem}.json"]
            + ["--markdown", runner.out / f"{stem.upper()}.md"],
        )


def _section(path: pathlib.Path, start: str) -> list[str]:
    """The lines of ``path`` from the one starting with ``start`` to a blank line."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    begin = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    if begin is None:
        return []
    end = next((i for i in range(begin + 2, len(lines)) if not lines[i]), len(lines))
    return lines[begin:end]


def _result(step: Step) -> str:
    """``ok``, ``timed out``, ``skipped`` (never started) or ``failed``.

    Skipped means the step did not run: no exit status. A test step's notes hold
    pytest's own ``skipped`` count, which says nothing about the step itself.
    """
    if step.ok:
        return "ok"
    if step.timed_out:
        return "timed out"
    return "skipped" if step.returncode is None else "failed"


def summary(runner: Runner, device: str, quick: bool, budget: float) -> str:
    """``GPU.md``: the steps, the tests, and the headline tables."""
    rows = [
        f"| {s.name} | {_result(s)} | {s.seconds} | {s.limit_s} | `{s.log}` |"
        for s in runner.steps
    ]
    env = next((s.notes for s in runner.steps if s.name == "environment"), {})
    tests = next((s.notes for s in runner.steps if s.name == "tests"), {})
    total = sum(s.seconds for s in runner.steps)
    table = _section(runner.out / "RESULTS.md", "| config | allocator | P |")
    gram = _section(runner.out / "RESULTS.md", "| config | allocator | P | route |")
    ntk = _section(runner.out / "NTK_ROUTES.md", "| model | B |")
    choice = _section(runner.out / "NTK_ROUTES.md", "| case | the default took |")
    constants = _section(runner.out / "ROUTE_COSTS.md", "| constants |")
    budgeted = _section(runner.out / "NTK_BUDGET.md", "| B | route | budget |")
    context = [
        line
        for stem in ("CONTEXT_FIT", "CONTEXT_LARGE", "CONTEXT_STEP")
        for line in [
            *_section(runner.out / f"{stem}.md", "| M | N | budget | dtype |"),
            *_section(runner.out / f"{stem}.md", "| M | N | minibatch |"),
            "",
        ]
    ]
    return "\n".join(
        [
            f"# laplace_diffjac on `{device}`" + (" (quick)" if quick else ""),
            "",
            f"`python benchmarks/gpu/run_on_gpu.py` — {total:.0f} s of a {budget:.0f} s"
            " budget.",
            "",
            f"- torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, GPUs: "
            f"{', '.join(env.get('gpus', [])) or 'none'}",
            f"- nvidia-smi: {env.get('nvidia-smi', 'not found')}",
            f"- Python: `{env.get('python', '?')}` on {env.get('platform', '?')}",
            "- device tests (`tests/test_devices.py`): "
            + (", ".join(f"{v} {k}" for k, v in tests.items()) or "not run"),
            "",
            "| step | result | seconds | limit (s) | log |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "## Jacobians (`RESULTS.md`)",
            "",
            *(table or ["(no table: see the log)"]),
            "",
            *gram,
            "",
            "## NTK routes (`NTK_ROUTES.md`)",
            "",
            *(ntk or ["(no table: see the log)"]),
            "",
            *choice,
            "",
            *constants,
            "",
            "## NTK within the memory budget (`NTK_BUDGET.md`)",
            "",
            *(budgeted or ["(no table: see the log)"]),
            "",
            "## Context posterior and location step (`CONTEXT_*.md`)",
            "",
            *(context if any(context) else ["(no table: see the logs)", ""]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the results (created)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds, all")
    parser.add_argument("--no-install", action="store_true", help="never pip")
    parser.add_argument("--find-links", default=None, help="a wheelhouse for pip")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    runner = Runner(out, args.budget)
    python = interpreter(runner, not args.no_install, args.find_links)
    if python is None:
        step = Step("setup", [NEEDED], 0.0, returncode=1)
        step.notes["error"] = "no interpreter imports the test dependencies"
        runner.steps.append(step)
    else:
        environment(runner, python, args.device)
        if runner.steps[-1].ok:
            steps(runner, python, args.device, args.quick)
    (out / "GPU.md").write_text(summary(runner, args.device, args.quick, args.budget))
    record = {
        "device": args.device,
        "quick": args.quick,
        "budget_s": args.budget,
        "steps": [asdict(s) | {"ok": s.ok} for s in runner.steps],
    }
    (out / "gpu_run.json").write_text(json.dumps(record, indent=1) + "\n")
    failed = [s.name for s in runner.steps if not s.ok]
    print(f"wrote {out / 'GPU.md'}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
