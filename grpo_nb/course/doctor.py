"""``python -m grpo_nb doctor`` — is this machine ready for the course?

It reads package versions from installed metadata (cheap: nothing heavy is imported except
torch, to ask about a GPU), then checks each notebook's requirements::

    installed metadata ──► Report(packages, device, memory, folders)
                                   │
                 NOTEBOOK_NEEDS ───┴──► per-notebook verdict ──► one-line fix, exit code

Every notebook's first code cell runs :func:`check`, a compact form that prints one status line
(and returns nothing, so the cell shows no object repr) or raises with the fix when the notebook
cannot run, so a learner sees the problem in cell 1, not in cell 20.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import sys
from dataclasses import dataclass, field

from grpo_nb.config import cache_dir, runs_dir, smoke_mode

# distribution name -> how to get it, phrased as a command a user can paste.
FIX_CORE = "pip install -e '.[cpu,dev]'  (or: make lab)"
FIXES: dict[str, str] = {
    "torch": FIX_CORE,
    "transformers": FIX_CORE,
    "datasets": FIX_CORE,
    "matplotlib": FIX_CORE,
    "ipywidgets": FIX_CORE,
    "tqdm": FIX_CORE,
    "vllm": "pip install -e '.[cpu]' on a CPU machine, or '.[gpu]' on an NVIDIA GPU (make lab GPU=1)",
    "torchmonarch": "pip install -e '.[monarch]'",
}


@dataclass(frozen=True)
class NotebookNeeds:
    """What one notebook needs to run: packages, free memory, and whether it is optional."""

    title: str
    packages: tuple[str, ...]
    min_free_gib: float = 1.0
    optional: bool = False


_BASE = ("torch", "matplotlib", "ipywidgets", "tqdm")
NOTEBOOK_NEEDS: dict[str, NotebookNeeds] = {
    "01": NotebookNeeds("actors and ports", _BASE),
    "02": NotebookNeeds("the toy GRPO ring", _BASE),
    "03": NotebookNeeds("the GRPO objective", _BASE),
    # A vLLM-CPU server takes ~2.2 GiB for the tiny model; the trainer needs a little more.
    "04": NotebookNeeds("vLLM rollouts", (*_BASE, "transformers", "datasets", "vllm"), 3.0),
    "05": NotebookNeeds("asynchronous GRPO", (*_BASE, "transformers", "datasets", "vllm"), 4.0),
    "06": NotebookNeeds("scale out with Monarch", (*_BASE, "torchmonarch"), 3.0, optional=True),
}


def _version(dist: str) -> str | None:
    # vLLM ships as "vllm" on GPU and "vllm-cpu" on CPU; both provide the `vllm` module.
    names = ("vllm", "vllm-cpu") if dist == "vllm" else (dist,)
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _cuda_torchvision_beside_cpu_torch(versions: dict[str, str | None]) -> bool:
    """pip drags PyPI's CUDA torchvision in next to a CPU torch; transformers then fails to import."""
    torch_v, tv = versions.get("torch") or "", _version("torchvision")
    return "+cpu" in torch_v and tv is not None and "+cpu" not in tv


@dataclass(repr=False)
class Report:
    versions: dict[str, str | None]
    device: str
    free_gib: float
    folders: dict[str, str]
    verdicts: dict[str, list[str]] = field(default_factory=dict)  # notebook -> problems
    warnings: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        # One line, for a notebook cell that ends with a Report: never the raw field dump.
        ready = [k for k, v in self.verdicts.items() if not v]
        blocked = [k for k, v in self.verdicts.items() if v]
        tail = f", not ready: {' '.join(blocked)}" if blocked else ""
        return (f"<doctor report: {self.device} · {self.free_gib:.1f} GiB free · "
                f"ready: {' '.join(ready) or 'none'}{tail}>")

    def problems(self, notebook: str | None = None, *, include_optional: bool = False) -> list[str]:
        keys = [notebook] if notebook else list(NOTEBOOK_NEEDS)
        out: list[str] = []
        for key in keys:
            if NOTEBOOK_NEEDS[key].optional and not include_optional and notebook is None:
                continue
            out += [p for p in self.verdicts.get(key, []) if p not in out]
        return out


def _device() -> str:
    try:
        import torch
    except ImportError:
        return "unknown (torch missing)"
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        return f"GPU: {torch.cuda.device_count()} × {', '.join(sorted(names))}"
    return f"CPU: {os.cpu_count()} cores ({platform.machine()}), no GPU"


def _free_gib() -> float:
    try:
        import psutil

        return psutil.virtual_memory().available / 2**30
    except ImportError:  # psutil is a core dependency; be useful anyway if it is missing
        return float("nan")


def diagnose() -> Report:
    """Collect versions, device, memory and folders, and judge every notebook."""
    dists = ("torch", "transformers", "datasets", "matplotlib", "ipywidgets", "tqdm", "vllm",
             "torchmonarch")
    versions = {d: _version(d) for d in dists}
    versions = {"python": platform.python_version(), **versions}
    report = Report(
        versions=versions,
        device=_device(),
        free_gib=_free_gib(),
        folders={
            "project cache": str(cache_dir()),
            "runs": str(runs_dir()),
            "vLLM compile cache": os.environ.get("VLLM_CACHE_ROOT", str(cache_dir() / "vllm")),
        },
    )
    torchvision_clash = _cuda_torchvision_beside_cpu_torch(versions)
    for key, needs in NOTEBOOK_NEEDS.items():
        problems = [f"{pkg} missing: {FIXES[pkg]}" for pkg in needs.packages if not versions[pkg]]
        if report.free_gib == report.free_gib and report.free_gib < needs.min_free_gib:
            problems.append(
                f"only {report.free_gib:.1f} GiB free, {needs.min_free_gib:.0f} GiB needed: "
                "close other notebooks/servers (Kernel > Shut Down All Kernels)"
            )
        if torchvision_clash and "transformers" in needs.packages:
            problems.append(
                "a CUDA torchvision sits beside a CPU torch, so transformers cannot import: "
                "pip uninstall -y torchvision torchaudio torchcodec"
            )
        report.verdicts[key] = problems
    return report


def status_line(report: Report, notebook: str) -> str:
    """``[doctor NN] python 3.11.2 · torch 2.6 · … · CPU: 2 cores … · 3.1 GiB free · smoke mode``."""
    shown = ["python", *NOTEBOOK_NEEDS[notebook].packages]
    line = " · ".join(f"{p} {report.versions[p] or 'MISSING'}" for p in shown)
    mode = "smoke" if smoke_mode() else "full"
    return f"[doctor {notebook}] {line} · {report.device} · {report.free_gib:.1f} GiB free · {mode} mode"


def check(notebook: str) -> None:
    """Compact doctor for a notebook's first cell: one status line, or a RuntimeError with the fix.

    Returns None on purpose: a cell ending in ``check("NN")`` then displays only the line.
    """
    if notebook not in NOTEBOOK_NEEDS:
        raise ValueError(f"unknown notebook {notebook!r}; known: {', '.join(NOTEBOOK_NEEDS)}")
    report = diagnose()
    needs = NOTEBOOK_NEEDS[notebook]
    print(status_line(report, notebook))
    for warning in report.warnings:
        print(f"[doctor {notebook}] warning: {warning}")
    problems = report.verdicts[notebook]
    if problems:
        raise RuntimeError(f"notebook {notebook} ({needs.title}) cannot run: {problems[0]}")


def format_report(report: Report) -> str:
    lines = ["grpo-notebooks doctor", ""]
    lines += [f"  {name:<14} {ver or 'not installed'}" for name, ver in report.versions.items()]
    lines += ["", f"  device         {report.device}", f"  free memory    {report.free_gib:.1f} GiB",
              f"  smoke mode     {smoke_mode()}"]
    lines += [f"  {name:<14} {path}" for name, path in report.folders.items()]
    lines += [partition_line(), ""]
    for key, needs in NOTEBOOK_NEEDS.items():
        problems = report.verdicts[key]
        tag = "ok" if not problems else ("optional, not ready" if needs.optional else "NOT READY")
        lines.append(f"  notebook {key} {needs.title:<24} {tag}")
        lines += [f"      - {p}" for p in problems]
    lines += [f"\n  warning: {w}" for w in report.warnings]
    return "\n".join(lines)


def partition_line() -> str:
    """Which cores the vLLM server and the trainer get (:mod:`grpo_nb.partition`)."""
    from grpo_nb import partition

    try:
        return f"  cpu partition  {partition.plan().describe()}"
    except ValueError as err:  # a bad GRPO_NB_SERVER_CPUS: say so, the doctor still runs
        return f"  cpu partition  invalid: {err}"


def orphan_section(reap: bool) -> str:
    """vLLM servers started by grpo_nb whose owner (kernel, CLI, test) is gone; ``reap`` ends them.

    Each holds ~2.2 GiB (tiny model, CPU) until stopped; the watchdog normally ends them within
    seconds of their owner's death, so an entry here means that safety net failed too.
    """
    from grpo_nb.serving import processes

    try:
        orphans = processes.find_orphans()
    except ImportError as err:  # psutil missing: say so rather than crash the doctor
        return f"  orphaned vLLM servers: cannot check ({err})"
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


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_nb doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--notebook", choices=sorted(NOTEBOOK_NEEDS), help="check one notebook only")
    parser.add_argument("--reap", action="store_true",
                        help="stop vLLM servers started by grpo_nb whose owner process is gone")
    args = parser.parse_args(argv)
    report = diagnose()
    print(format_report(report))
    print(orphan_section(args.reap))
    problems = report.problems(args.notebook)
    if problems:
        print(f"\nnot ready: {problems[0]}", file=sys.stderr)
        return 1
    print("\nready.")
    return 0
