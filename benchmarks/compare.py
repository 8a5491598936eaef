"""Run the cases of ``benchmarks/run.py`` under laplace-ng and laplace-torch 0.3; print ratios.

The reference runs in another interpreter (``--ref-python``, a throwaway virtual environment
made by ``benchmarks/compare.sh``) where ``import laplace`` is laplace-torch 0.3. Both sides run
the same ``run.py --one CASE`` in their own subprocess, so each timed part goes through the
public API only; laplace-ng's side imports this checkout's ``src/``. ``--rounds N`` runs both
sides N times, alternating, and reports the medians (use it on a shared machine, with
``--threads 1``). ``--ref-src DIR`` makes the reference another revision of laplace-ng instead
(its ``src/``, e.g. from ``git worktree add``, run by this interpreter): an A/B of a change. A
case is bounded by ``--timeout`` seconds and ``--max-rss-gb`` of resident
memory; a case the reference cannot run is reported with the reason. Writes
``benchmarks/results/compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN = HERE / "run.py"
#: The ``src/`` of this checkout: laplace-ng's side imports it, not an installed copy.
SRC = HERE.parent / "src"
#: Cases that use laplace-ng internals (the backend registry, eigenvalue error bounds) or
#: structures laplace-torch lacks (EKFAC, INF).
OURS_ONLY_PREFIXES = (
    "backend-",
    "lowrank-accuracy",
    "fit-ekfac",
    "fit-ll-ekfac",
    "predict-ekfac",
    "fit-inf",
    "predict-inf",
)


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its children (bytes)."""
    total = 0
    try:
        out = subprocess.run(
            ["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)],
            capture_output=True,
            text=True,
        ).stdout
        total = sum(int(x) for x in out.split()) * 1024
    except (OSError, ValueError):
        pass
    return total


def run_case(
    python: str,
    case: str,
    repeats: int,
    timeout: float,
    max_rss: float,
    threads: int = 2,
    src: Path | None = None,
) -> dict:
    """Run one case in a fresh interpreter; return its row or ``{"error": reason}``.

    ``src``: the ``src/`` folder whose ``laplace`` the interpreter imports (laplace-ng: this
    checkout's); None: the interpreter's own (laplace-torch in its throwaway venv).
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [
                python,
                str(RUN),
                "--one",
                case,
                "--repeats",
                str(repeats),
                "--threads",
                str(threads),
            ],
            stdout=out,
            stderr=err,
            env=env,
            cwd=tempfile.gettempdir(),  # so that `import laplace` never finds the repo's src/
            start_new_session=True,
        )
        start, reason = time.monotonic(), None
        while proc.poll() is None:
            if time.monotonic() - start > timeout:
                reason = f"> {timeout:.0f} s"
            elif rss_bytes(proc.pid) > max_rss:
                reason = f"> {max_rss / 2**30:.0f} GB resident memory"
            if reason:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"error": reason}
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        last = [line for line in stderr.strip().splitlines() if line.strip()]
        return {"error": f"failed: {last[-1][:160] if last else proc.returncode}"}
    return json.loads(stdout.strip().splitlines()[-1])


def median_row(rows: list[dict]) -> dict:
    """One row for several rounds: the median time (every round's in ``rounds_s``); the first
    error if a round failed."""
    errors = [row for row in rows if "seconds" not in row]
    if errors:
        return errors[0]
    times = [row["seconds"] for row in rows]
    ordered = sorted(rows, key=lambda row: row["seconds"])
    middle = ordered[(len(ordered) - 1) // 2]
    return {**middle, "seconds": statistics.median(times), "rounds_s": times}


def main() -> None:
    sys.path.insert(0, str(HERE))
    from run import BACKEND_CASES, CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [c for c in CASES if c not in BACKEND_CASES]
    reference = parser.add_mutually_exclusive_group(required=True)
    reference.add_argument("--ref-python", help="interpreter with laplace-torch 0.3")
    reference.add_argument("--ref-src", type=Path, help="src/ of another laplace-ng revision")
    parser.add_argument("--cases", nargs="*", default=default, choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case and side")
    parser.add_argument("--max-rss-gb", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each side this many times, alternating (ng, torch, ng, ...); medians reported",
    )
    args = parser.parse_args()
    max_rss = args.max_rss_gb * 2**30
    ours_python = sys.executable
    ref_python, ref_name = args.ref_python or ours_python, "laplace-torch"
    if args.ref_src:
        ref_name = "reference"
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'case':48s} {'laplace-ng':>12s} {ref_name:>14s} {'ratio':>8s}  memory")
    rows = []
    for case in args.cases:
        runs: dict[str, list[dict]] = {"ours": [], "ref": []}
        for _ in range(args.rounds):
            runs["ours"].append(
                run_case(ours_python, case, args.repeats, args.timeout, max_rss, args.threads, SRC)
            )
            if case.startswith(OURS_ONLY_PREFIXES) and not args.ref_src:
                runs["ref"].append({"error": "skipped: uses laplace-ng internals"})
            else:
                runs["ref"].append(
                    run_case(
                        ref_python,
                        case,
                        args.repeats,
                        args.timeout,
                        max_rss,
                        args.threads,
                        args.ref_src.resolve() if args.ref_src else None,
                    )
                )
        ours, ref = median_row(runs["ours"]), median_row(runs["ref"])
        row = {"case": case, "laplace_ng": ours, "laplace_torch": ref}
        ours_s = ours.get("seconds")
        ref_s = ref.get("seconds")
        if ours_s and ref_s:
            row["ratio"] = ref_s / ours_s
            ratio = f"{row['ratio']:7.1f}x"
        elif ours_s and ref.get("error", "").startswith(">"):
            ratio = f"> {args.timeout / ours_s:.0f}x"
        else:
            ratio = "-"
        mem = ""
        if "peak_extra_MB" in ours and "peak_extra_MB" in ref:
            mem = f"+{ours['peak_extra_MB']:.0f} MB vs +{ref['peak_extra_MB']:.0f} MB"
        ours_txt = f"{ours_s:.3f} s" if ours_s is not None else ours["error"]
        ref_txt = f"{ref_s:.3f} s" if ref_s is not None else ref["error"]
        print(f"{case:48s} {ours_txt:>12s} {ref_txt:>14s} {ratio:>8s}  {mem}", flush=True)
        rows.append(row)
    (HERE / "results").mkdir(exist_ok=True)
    out_file = HERE / "results" / "compare.json"
    out_file.write_text(json.dumps(rows, indent=2))
    print(f"ratio = {ref_name} time / laplace-ng time (above 1: laplace-ng is faster)")
    print(f"results written to {out_file}")


if __name__ == "__main__":
    main()
