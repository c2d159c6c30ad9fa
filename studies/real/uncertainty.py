"""Command of the study's uncertainty parts: ``python -m studies.real.uncertainty``.

``--part ood``: digits trained on classes 0–4, the test inputs of 5–9
out-of-distribution (AUROC from predictive entropy and latent variance, selective
prediction on the in-distribution test set). ``--part shift``: every data set, test
inputs corrupted at increasing severity (digits: pixel noise and rotations; the
tabular sets: moved beyond the training range), NLPD/ECE/accuracy against severity
and selective prediction. Same methods, fits, δ selection and options as
``python -m studies.real`` (``--quick``: tiny sizes, well under a minute).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``studies.real`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "studies.real"

from .probes import PARTS  # noqa: E402
from .run import build_parser, configs, execute  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: The defaults of each part: what the committed runs used (README).
DEFAULTS: dict[str, dict] = {
    "ood": {
        "datasets": ["digits"],
        "seeds": [68, 117, 36],
        "fractions": [0.01, 0.02, 0.05, 0.10, 0.20],
        "quick": {
            "datasets": ["digits"],
            "seeds": [68],
            "fractions": [0.05],
            "steps": 3,
            "valla_iterations": 2,
            "epochs": 30,
            "width": 8,
            "grid": [0.1, 1.0, 10.0],
        },
    },
    "shift": {
        "datasets": ["digits", "breast_cancer", "wine", "diabetes"],
        "seeds": [68, 117],
        "fractions": [0.02, 0.05, 0.10],
        "quick": {
            "datasets": ["digits", "diabetes"],
            "seeds": [68],
            "fractions": [0.02],
            "steps": 3,
            "valla_iterations": 2,
            "epochs": 50,
            "width": 16,  # width 8: laplace-torch's GP-subset Cholesky fails on digits
            "grid": [0.1, 1.0, 10.0],
        },
    },
}


def main(argv: list[str] | None = None) -> None:
    """Run one part and write its report into ``--out`` (default ``results/<part>``)."""
    from .uncertainty_report import write_part_report

    parser = build_parser(__doc__)
    parser.add_argument("--part", choices=PARTS, required=True)
    args = parser.parse_args(argv)
    if args.out == parser.get_default("out"):
        args.out = RESULTS / args.part
    settings = configs(args, DEFAULTS[args.part], args.part)

    def write(records, out, command, run):
        return write_part_report(records, out, command, run, args.part)

    execute(args, settings, "python -m studies.real.uncertainty", write, argv)


if __name__ == "__main__":
    main()
