"""Install a device bundle on an offline GPU host and test the vLLM series there.

This file is copied into every bundle by ``harness.bundle`` and runs on the
GPU host with that host's ``python3`` (3.12, torch 2.11) and the standard
library alone: nothing from the harness is installed there. ::

    python3 .bundle/device_run.py --out "$OUT" [-k EXPR] [--test NODEID ...]
        [--replay "path/to/script.py --arg value" ...] [--prefix /tmp/vllm-bundle]
        [--time-limit SECONDS]

Steps, each recorded in ``<out>/results.json`` as soon as it ends (so a run
cut short still says how far it got). The file has the project's result
shape (see ``harness.results``): ``{"schema": 1, "kind": "device-run",
"provenance": {...}, "data": {...}}``, with the base pin, series hash and tree
commit taken from the bundle's ``provenance.json`` and the host's GPU, driver,
CUDA, torch and Python probed here; the steps below are under ``data``:

1. **install**: check every file against ``MANIFEST.txt``; unpack the vLLM
   tree and kernel libraries into ``<prefix>/py``, the tests into
   ``<prefix>/tests``, and ``pip install --no-index --no-deps --target
   <prefix>/site`` the wheels the manifest lists (any other ``.whl`` in
   ``wheels/`` is named in the log and in the record's ``unlisted_wheels``,
   and left alone); byte-compile both trees once (the children run with
   ``PYTHONDONTWRITEBYTECODE``). Nothing outside ``<prefix>`` is written
   but ``<out>``.
2. **smoke** (in a child process with ``PYTHONPATH=<prefix>/py:<prefix>/site``):
   vLLM imports and picks the CUDA platform; one kernel of each carried
   library against a torch reference (``_moe_C`` topk_softmax, ``_C``
   silu_and_mul, and an NVFP4 Marlin MoE which uses both); each extra library
   loads and registers ops in its namespace.
3. **pytest** over the bundle's selected tests (or ``--test``), run from
   ``<prefix>/tests`` with ``-rfEs`` and ``--junitxml``; counts of passed,
   failed, errors and skipped tests (with each skip's reason) come from the
   JUnit XML. A time limit interrupts pytest (SIGINT), which still writes the
   XML of what ran.
4. **replays**: each ``--replay`` command runs under the same environment with
   its output in ``<out>/replay-N.log``; ``VLLM_BUNDLE_OUT`` names ``<out>``
   and ``VLLM_BUNDLE_TREE_COMMIT`` the bundle's vLLM tree commit, and
   ``VLLM_BUNDLE_SERIES_HASH`` its series hash when that tree is the series' head.
   ``--time-limit`` bounds the whole run: every step's timeout is cut to what is
   left of it less :data:`WRAP_UP_S` (the SIGINT-to-SIGKILL grace, the output
   reader's join and the final write), so a step that is cut still ends, and
   ``results.json`` is written, within the limit. Each child learns the
   seconds it has before its SIGINT from ``VLLM_BUNDLE_TIME_LEFT_S``
   (``harness replay e2e`` plans by it).

A section passes only when something ran and nothing failed: skipped tests,
a smoke not run, or no tests collected never count as passing. The exit
status is 0 only when every section that ran passed.

Files written to ``<out>``: results.json, junit.xml, install.log, smoke.log,
pytest.log and replay-N.log (at most 8 files come back from a device call).
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The result-file shape of ``harness.results`` (SCHEMA, REQUIRED and the
# provenance fields that ``harness.results.provenance`` fills), repeated here
# on purpose: this file runs on the GPU host from the bundle folder, where the
# harness is not installed, and ``harness.results`` needs ``harness.project``
# (the repository's pin files), so it cannot be imported. Only these two
# constants, :func:`_gpu_and_driver` and :func:`result_provenance` repeat it;
# ``tests/test_bundle.py`` checks that they match ``harness.results`` and that
# a produced file passes ``harness.results.validate``.
SCHEMA = 1
REQUIRED = ("command", "date", "host", "gpu", "driver", "cuda", "torch", "python", "base")
KIND = "device-run"
MARKER = ".vllm-device-bundle"
PASSED, FAILED, SKIPPED, NOT_RUN, TIMED_OUT, NO_TESTS = (
    "passed",
    "failed",
    "skipped",
    "not-run",
    "timed-out",
    "no-tests",
)
SMOKE_CHILD = "_smoke"
PROBE_CHILD = "_probe"


class BundleError(RuntimeError):
    """The bundle cannot be installed (bad manifest, bad prefix, failed unpack)."""


# --------------------------------------------------------------------------- install


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_manifest(bundle: Path) -> list[str]:
    """Check every file ``MANIFEST.txt`` lists; return their paths.

    Raises:
        BundleError: a file is missing, truncated or changed.
    """
    manifest = bundle / "MANIFEST.txt"
    if not manifest.is_file():
        raise BundleError(f"{manifest} is missing: not a device bundle")
    listed = []
    for line in manifest.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        digest, size, rel = line.split("  ", 2)
        path = bundle / rel
        if not path.is_file() or path.stat().st_size != int(size):
            raise BundleError(f"{rel}: missing or of the wrong size (manifest says {size} bytes)")
        if sha256(path) != digest:
            raise BundleError(f"{rel}: sha256 differs from the manifest")
        listed.append(rel)
    return listed


def prepare_prefix(prefix: Path) -> None:
    """Empty ``prefix`` for a fresh install; refuse a folder this script did not make."""
    if prefix.resolve() in (Path("/"), Path.home().resolve()) or len(prefix.resolve().parts) < 3:
        raise BundleError(f"refusing to install into {prefix}: give a dedicated folder")
    if prefix.exists():
        if any(prefix.iterdir()) and not (prefix / MARKER).exists():
            raise BundleError(
                f"{prefix} exists and was not made by device_run.py; choose another --prefix"
            )
        shutil.rmtree(prefix)
    prefix.mkdir(parents=True)
    (prefix / MARKER).write_text("made by device_run.py; removed and rebuilt on each install\n")


def unpack(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")


def join_wheel_parts(folder: Path, dest: Path) -> list[Path]:
    """Join the parts of a wheel group that earlier calls left in ``folder``; return its wheels.

    Every part ``parts.json`` lists must be there with its sha256, and so must
    the joined tar and each wheel in it; the wheels are unpacked into ``dest``.

    Raises:
        BundleError: a part is missing or changed, or the joined bytes do not check.
    """
    try:
        manifest = json.loads((folder / PARTS_MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{folder}: no readable {PARTS_MANIFEST} ({exc})") from exc
    parts = manifest["parts"]
    if missing := [p["name"] for p in parts if not (folder / p["name"]).is_file()]:
        raise BundleError(
            f"{folder}: {len(missing)} of {len(parts)} parts of wheel group "
            f"{manifest['group']!r} are missing ({', '.join(missing)}): copy each carried "
            "part into this folder, one device call each, while the host stays warm"
        )
    if bad := [p["name"] for p in parts if sha256(folder / p["name"]) != p["sha256"]]:
        raise BundleError(f"{folder}: parts {', '.join(bad)} do not match {PARTS_MANIFEST}")
    dest.mkdir(parents=True, exist_ok=True)
    joined = dest / WHEELS_TAR
    with joined.open("wb") as out:
        for part in parts:
            with (folder / part["name"]).open("rb") as fh:
                shutil.copyfileobj(fh, out)
    if sha256(joined) != manifest["tar_sha256"]:
        raise BundleError(f"{folder}: the joined parts do not match {PARTS_MANIFEST}")
    unpack(joined, dest)
    joined.unlink()
    wheels = []
    for wheel in manifest["wheels"]:
        path = dest / wheel["name"]
        if not path.is_file() or sha256(path) != wheel["sha256"]:
            raise BundleError(f"{folder}: wheel {wheel['name']} does not match {PARTS_MANIFEST}")
        wheels.append(path)
    return wheels


def install(
    bundle: Path,
    prefix: Path,
    log: Callable[[str], object],
    wheel_parts: Sequence[Path] = (),
) -> dict[str, Any]:
    """Verify and install the bundle under ``prefix``; return the install record.

    ``wheel_parts``: folders of wheel groups joined by :func:`join_wheel_parts`,
    installed with the bundle's own wheels.
    """
    start = time.time()
    provenance = json.loads((bundle / "provenance.json").read_text())
    listed = verify_manifest(bundle)
    prepare_prefix(prefix)
    contents = provenance["contents"]
    unpack(bundle / contents["python"]["archive"], prefix / "py")
    for kernel in contents["kernels"]:
        unpack(bundle / kernel["archive"], prefix / "py")
    unpack(bundle / contents["tests"]["archive"], prefix / "tests")
    # Only the wheels the manifest verified: a wheel left in wheels/ by an earlier
    # bundle or by hand would otherwise be installed unchecked beside them.
    wheels = sorted(
        bundle / rel for rel in listed if rel.startswith("wheels/") and rel.endswith(".whl")
    )
    present = {w.name for w in (bundle / "wheels").glob("*.whl")}
    unlisted = sorted(present - {w.name for w in wheels})
    if unlisted:
        log(f"not installed, not in MANIFEST.txt: {', '.join(unlisted)}")
    extra = [w for folder in wheel_parts for w in join_wheel_parts(folder, prefix / "parts")]
    wheels += extra
    if wheels:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--quiet",
            "--target",
            str(prefix / "site"),
            *map(str, wheels),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        log("$ " + shlex.join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise BundleError(f"pip install of the carried wheels failed:\n{proc.stderr[-2000:]}")
    # Byte-compile once, on every core: the children run with PYTHONDONTWRITEBYTECODE
    # (see environment()), so otherwise each server process and each `vllm bench`
    # client would compile the imported sources again. A file that does not compile
    # (one written for another Python) is left to fail where it is imported.
    for folder in ("py", "site"):
        if (prefix / folder).is_dir():
            compileall.compile_dir(prefix / folder, quiet=2, workers=0)
    return {
        "status": PASSED,
        "seconds": round(time.time() - start, 1),
        "wheels": len(wheels),
        "wheel_parts": [w.name for w in extra],
        "unlisted_wheels": unlisted,
    }


#: Names the vLLM tree commit of the bundle in the environment of replays.
BUNDLE_TREE_ENV = "VLLM_BUNDLE_TREE_COMMIT"
#: Names the bundle's series hash beside it, only when that tree is the series' head.
BUNDLE_SERIES_ENV = "VLLM_BUNDLE_SERIES_HASH"
#: Tells each child (smoke, pytest, replay) how many seconds it has before it is
#: sent SIGINT; ``harness.e2e`` reads it (``tests/test_bundle.py`` checks the name).
TIME_LEFT_ENV = "VLLM_BUNDLE_TIME_LEFT_S"
#: Seconds between a cut child's SIGINT and its SIGKILL: enough for ``harness replay
#: e2e`` to stop its bench and server (``harness.e2e.STOP_TIMEOUT_S`` each, then
#: SIGKILL and up to 10 s) and write its summary.
KILL_GRACE_S = 45.0
#: How long the output reader may take after the child ends (a SIGKILLed child's
#: own children can hold the pipe open).
READER_JOIN_S = 10.0
#: What a step keeps back from ``--time-limit``: the kill grace, the reader's join
#: and the write of ``results.json``.
WRAP_UP_S = KILL_GRACE_S + READER_JOIN_S + 5.0
#: The manifest and the joined tar of a wheel group split for several calls
#: (``harness bundle --wheel-group``; see :func:`join_wheel_parts`).
PARTS_MANIFEST = "parts.json"
WHEELS_TAR = "wheels.tar"


def pth_paths(site_dir: Path) -> list[str]:
    """What the ``.pth`` files of ``site_dir`` add to ``sys.path``.

    ``pip install --target`` leaves ``.pth`` files unprocessed, and a folder on
    ``PYTHONPATH`` is not a site directory; the CUTLASS DSL's wheel relies on
    its ``.pth`` to put its packages on the path. A child interpreter
    processes them with :func:`site.addsitedir` and reports the additions.
    """
    if not any(site_dir.glob("*.pth")):
        return []
    code = (
        "import json, site, sys; before = set(sys.path); site.addsitedir(sys.argv[1]); "
        "print(json.dumps([p for p in sys.path if p not in before and p != sys.argv[1]]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(site_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BundleError(f"processing the .pth files of {site_dir} failed:\n{proc.stderr}")
    return [str(p) for p in json.loads(proc.stdout)]


def environment(prefix: Path, out: Path, provenance: dict[str, Any]) -> dict[str, str]:
    """The environment the smoke check, pytest and replays run in."""
    env = dict(os.environ)
    paths = [str(prefix / "py"), str(prefix / "site"), *pth_paths(prefix / "site")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    extra = [
        str(prefix / "py" / k["name"]) for k in provenance["contents"]["kernels"] if k["namespace"]
    ]
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        VLLM_BUNDLE_PREFIX=str(prefix),
        VLLM_BUNDLE_OUT=str(out),
        VLLM_BUNDLE_EXTRA_KERNELS=os.pathsep.join(extra),
    )
    tree = provenance.get("tree", {}).get("commit")
    if tree:
        # Replays record it as their tree_commit (harness.results): on this host
        # the code under test is the bundle's tree, not a built wheel.
        env[BUNDLE_TREE_ENV] = str(tree)
    # A bundle of another revision than the series' head has no series hash,
    # whatever the caller's environment says.
    env.pop(BUNDLE_SERIES_ENV, None)
    if series := provenance.get("series_hash"):
        env[BUNDLE_SERIES_ENV] = str(series)
    # Marlin MoE reaches sm_90 as PTX; let the driver cache the JIT output
    # beyond its 256 MiB default so repeated runs on a warm host reuse it.
    env.setdefault("CUDA_CACHE_MAXSIZE", str(4 << 30))
    # FlashInfer does not travel. On CUDA, vLLM's top-k/top-p sampler asks
    # whether FlashInfer's sampler can be used by importing vLLM's FlashInfer
    # attention backend, which imports flashinfer: without this a server fails
    # while building its sampler (v1/sample/ops/topk_topp_sampler.py).
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


# --------------------------------------------------------------------------- provenance


def host_provenance(env: dict[str, str]) -> dict[str, Any]:
    """GPU, driver, CUDA, torch and Python of the host (torch is probed in a child)."""
    record: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "machine": platform.machine(),
        "kernel": platform.release(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0:
            record["nvidia_smi"] = [
                line.strip() for line in proc.stdout.splitlines() if line.strip()
            ]
            first = record["nvidia_smi"][0].split(", ") if record["nvidia_smi"] else []
            if len(first) >= 2:
                record["gpu"], record["driver"] = first[0], first[1]
    proc = subprocess.run(
        [sys.executable, __file__, PROBE_CHILD],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    try:
        record.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (IndexError, json.JSONDecodeError):
        record["torch_probe_error"] = (proc.stderr or proc.stdout)[-1000:]
    return record


def _gpu_and_driver(smi_lines: Sequence[str]) -> tuple[str, str]:
    """``(gpu, driver)`` from ``nvidia-smi --query-gpu=name,driver_version,...`` lines.

    As ``harness.results`` writes them: ``"NVIDIA H200"`` for one GPU,
    ``"2x NVIDIA H200"`` for several alike, ``"; "``-joined names for a mix,
    and ``"none"`` without nvidia-smi or a GPU.
    """
    rows = [line.split(",") for line in smi_lines if line.strip()]
    if not rows or len(rows[0]) < 2:
        return "none", "none"
    names = [row[0].strip() for row in rows]
    gpu = names[0] if len(set(names)) == 1 else "; ".join(names)
    return (f"{len(names)}x {gpu}" if len(names) > 1 else gpu), rows[0][1].strip()


def result_provenance(
    command: str, date: str, bundle_provenance: dict[str, Any], host: dict[str, Any]
) -> dict[str, Any]:
    """The ``provenance`` of ``results.json``, with the fields of ``harness.results.provenance``.

    ``base`` and ``series_hash`` come from the bundle's ``provenance.json``
    and ``tree_commit`` from its ``tree``; the host fields from
    :func:`host_provenance`.
    """
    gpu, driver = _gpu_and_driver(host.get("nvidia_smi", []))
    if "torch" in host:
        torch_version, cuda = str(host["torch"]), str(host.get("torch_cuda") or "none")
    elif "torch_error" in host:
        torch_version, cuda = "not installed", "none"
    else:
        torch_version, cuda = "unknown", "unknown"
    base = bundle_provenance.get("base", {})
    record: dict[str, Any] = {
        "command": command,
        "date": date,
        "host": platform.node() or "unknown",
        "gpu": gpu,
        "driver": driver,
        "cuda": cuda,
        "torch": torch_version,
        "python": platform.python_version(),
        "base": {
            k: base.get(k, "unknown")
            for k in ("version", "sdist_sha256", "upstream_commit", "base_commit")
        },
    }
    if "series_hash" in bundle_provenance:
        record["series_hash"] = bundle_provenance["series_hash"]
    if "commit" in bundle_provenance.get("tree", {}):
        record["tree_commit"] = bundle_provenance["tree"]["commit"]
    return record


def probe() -> None:
    """Child: print torch's view of the host as one JSON line."""
    info: dict[str, Any] = {}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["torch_gpu"] = torch.cuda.get_device_name(0)
            major, minor = torch.cuda.get_device_capability(0)
            info["capability"] = f"{major}.{minor}"
            info["gpu_count"] = torch.cuda.device_count()
    except Exception as exc:
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(info))


# --------------------------------------------------------------------------- smoke


def smoke(result_file: Path) -> None:
    """Child: the kernel smoke check; writes ``{"checks": [...]}`` to ``result_file``."""
    checks: list[dict[str, Any]] = []

    def check(name: str, fn: Callable[[], str | None]) -> None:
        start = time.time()
        try:
            detail = fn()
            status, message = PASSED, detail or ""
        except Exception as exc:
            import traceback

            status, message = FAILED, f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        checks.append(
            {
                "name": name,
                "status": status,
                "seconds": round(time.time() - start, 1),
                "detail": message,
            }
        )
        print(f"[{status}] {name} ({checks[-1]['seconds']}s) {message}", flush=True)
        result_file.write_text(json.dumps({"checks": checks}))

    check("torch sees a CUDA device", _need_cuda)
    check("vllm imports on the CUDA platform", _check_imports)
    if any(c["status"] != PASSED for c in checks):
        return  # no kernels to check without a GPU and an importable vLLM
    check("_moe_C topk_softmax (fused_topk) vs torch", _check_topk)
    check("_C silu_and_mul vs torch", _check_silu_and_mul)
    check(
        "Marlin MoE NVFP4 (_C gptq_marlin_repack + _moe_C moe_wna16_marlin_gemm) vs torch",
        _check_marlin_moe_nvfp4,
    )
    for path in filter(None, os.environ.get("VLLM_BUNDLE_EXTRA_KERNELS", "").split(os.pathsep)):
        namespace = Path(path).parent.name
        check(
            f"extra library {Path(path).name} registers torch.ops.{namespace}",
            functools.partial(_check_extra_library, path, namespace),
        )


def _need_cuda() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return str(torch.cuda.get_device_name(0))


def _check_imports() -> str:
    import vllm
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory  # noqa: F401
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe  # noqa: F401
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE  # noqa: F401
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise RuntimeError(f"vLLM picked {type(current_platform).__name__}, not the CUDA platform")
    device = VllmConfig().device_config.device
    return f"vllm {vllm.__version__} from {Path(vllm.__file__).parent}, device {device}"


def _check_topk() -> str:
    import torch
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    torch.manual_seed(0)
    tokens, experts, topk = 64, 16, 4
    hidden = torch.randn(tokens, 128, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.float32)
    weights, ids, _ = fused_topk(hidden, logits, topk, False)
    ref_weights, ref_ids = torch.topk(torch.softmax(logits, -1), topk)
    torch.testing.assert_close(weights.float(), ref_weights, atol=1e-4, rtol=1e-4)
    if not torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values):
        raise AssertionError("topk_softmax picked other experts than torch.topk")
    return f"{tokens} tokens, {experts} experts, top-{topk}"


def _check_silu_and_mul() -> str:
    import torch
    import torch.nn.functional as F
    import vllm._custom_ops  # noqa: F401 - registers the ops' Python side

    torch.manual_seed(0)
    x = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(32, 512, device="cuda", dtype=torch.bfloat16)
    torch.ops._C.silu_and_mul(out, x)
    ref = F.silu(x[:, :512].float()) * x[:, 512:].float()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    return f"max abs err {(out.float() - ref).abs().max().item():.4f}"


def _check_marlin_moe_nvfp4() -> str:
    """fused_marlin_moe with NVFP4 weights vs an fp32 torch reference (vLLM's test tolerance)."""
    import torch
    import torch.nn.functional as F
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        rand_marlin_weight_nvfp4_like,
    )
    from vllm.scalar_type import scalar_types

    torch.manual_seed(0)
    m, n, k, experts, topk, group = 33, 256, 512, 8, 2, 16
    dtype = torch.float16
    a = torch.randn(m, k, device="cuda", dtype=dtype) / 10
    w1 = torch.randn(experts, 2 * n, k, device="cuda", dtype=dtype) / 10
    w2 = torch.randn(experts, k, n, device="cuda", dtype=dtype) / 10

    def quantize(w: Any) -> tuple[Any, Any, Any, Any]:
        make = rand_marlin_weight_nvfp4_like
        parts = [make(w[e], group) for e in range(w.shape[0])]
        ref = torch.stack([p[0].T for p in parts])
        return (
            ref,
            torch.stack([p[1] for p in parts]).contiguous(),
            torch.stack([p[2] for p in parts]),
            torch.stack([p[3] for p in parts]),
        )

    w1_ref, w1_q, w1_s, w1_g = quantize(w1)
    w2_ref, w2_q, w2_s, w2_g = quantize(w2)
    score = torch.randn(m, experts, device="cuda", dtype=dtype)
    weights, ids, _ = fused_topk(a, score, topk, False)
    with set_current_vllm_config(VllmConfig()):
        out = fused_marlin_moe(
            a,
            w1_q,
            w2_q,
            None,
            None,
            w1_s,
            w2_s,
            weights,
            ids,
            quant_type_id=scalar_types.float4_e2m1f.id,
            global_num_experts=experts,
            global_scale1=w1_g,
            global_scale2=w2_g,
        )
    ref = torch.zeros(m, k, device="cuda", dtype=torch.float32)
    for slot in range(topk):
        for e in range(experts):
            rows = ids[:, slot] == e
            if rows.any():
                h = a[rows].float() @ w1_ref[e].float().T
                act = (F.silu(h[:, :n]) * h[:, n:]).to(dtype).float()
                ref[rows] += weights[rows, slot : slot + 1].float() * (act @ w2_ref[e].float().T)
    torch.testing.assert_close(out.float(), ref, atol=4e-2, rtol=0)
    err = (out.float() - ref).abs().max().item()
    return f"m={m} n={n} k={k} e={experts} top-{topk}, max abs err {err:.4f}"


def _check_extra_library(path: str, namespace: str) -> str:
    import torch

    torch.ops.load_library(path)
    ops = sorted(o for o in torch._C._dispatch_get_all_op_names() if o.startswith(f"{namespace}::"))
    if not ops:
        raise RuntimeError(f"{path} loaded but registered nothing in torch.ops.{namespace}")
    return f"{len(ops)} ops: " + ", ".join(o.split("::", 1)[1] for o in ops[:8])


def time_left(timeout: float, deadline: float | None) -> float:
    """A step's timeout: ``timeout``, cut to what is left before ``deadline`` (a
    ``time.monotonic()`` value) less :data:`WRAP_UP_S`, so that a step cut at its
    timeout still ends, SIGKILL included, before the deadline. Zero or less: the step
    has no time left and is not started."""
    if deadline is None:
        return timeout
    return min(timeout, deadline - WRAP_UP_S - time.monotonic())


def _not_started(record: dict[str, Any]) -> dict[str, Any]:
    """The record of a step that the time limit left no time for."""
    return {**record, "status": TIMED_OUT, "seconds": 0.0, "note": "not started: no time left"}


def run_smoke(env: dict[str, str], out: Path, timeout: float) -> dict[str, Any]:
    """Run :func:`smoke` in a child process; return its record."""
    if timeout <= 0:
        return _not_started({"exit_code": None, "checks": []})
    result_file = out / ".smoke.json"
    result_file.unlink(missing_ok=True)
    start = time.time()
    with (out / "smoke.log").open("w") as log:
        code, timed_out = _run_logged(
            [sys.executable, __file__, SMOKE_CHILD, str(result_file)],
            env=env,
            cwd=out,
            log=log,
            timeout=timeout,
        )
    checks = json.loads(result_file.read_text())["checks"] if result_file.exists() else []
    result_file.unlink(missing_ok=True)
    ok = bool(checks) and all(c["status"] == PASSED for c in checks) and code == 0
    status = TIMED_OUT if timed_out else PASSED if ok else FAILED
    return {
        "status": status,
        "exit_code": code,
        "seconds": round(time.time() - start, 1),
        "checks": checks,
    }


# --------------------------------------------------------------------------- pytest


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and details of a pytest JUnit XML file.

    Returns ``passed``/``failed``/``errors``/``skipped`` counts, the skipped
    tests with their reasons and the failed/errored tests with their messages.
    """
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skipped: list[dict[str, str]] = []
    failed: list[dict[str, str]] = []
    for case in root.iter("testcase"):
        test = "::".join(filter(None, [case.get("classname", ""), case.get("name", "")]))
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                message = child.get("message", "") or (child.text or "").strip()[:500]
                break
        if outcome == "passed":
            counts["passed"] += 1
        elif outcome == "skipped":
            counts["skipped"] += 1
            skipped.append({"test": test, "reason": message})
        else:
            counts["failed" if outcome == "failure" else "errors"] += 1
            failed.append({"test": test, "kind": outcome, "message": message[:500]})
    return {**counts, "skipped_tests": skipped, "failed_tests": failed}


def pytest_status(counts: dict[str, Any], exit_code: int | None, timed_out: bool) -> str:
    """One word for a pytest run; only a clean run with at least one pass is ``passed``."""
    if timed_out:
        return TIMED_OUT
    if counts.get("failed") or counts.get("errors") or exit_code not in (0, 5):
        return FAILED
    if counts.get("passed"):
        return PASSED
    return SKIPPED if counts.get("skipped") else NO_TESTS


def run_pytest(
    env: dict[str, str],
    prefix: Path,
    out: Path,
    tests: Sequence[str],
    keyword: str | None,
    extra_args: Sequence[str],
    timeout: float,
) -> dict[str, Any]:
    """Run pytest over ``tests`` from ``<prefix>/tests``; return counts and status."""
    no_counts: dict[str, Any] = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    no_counts.update(skipped_tests=[], failed_tests=[])
    if timeout <= 0:
        return _not_started({"exit_code": None, **no_counts})
    junit = out / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *tests,
        "-rfEs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *(["-k", keyword] if keyword else []),
        *extra_args,
    ]
    start = time.time()
    with (out / "pytest.log").open("w") as log:
        code, timed_out = _run_logged(cmd, env=env, cwd=prefix / "tests", log=log, timeout=timeout)
    record: dict[str, Any] = {
        "command": shlex.join(cmd[1:]),
        "cwd": str(prefix / "tests"),
        "exit_code": code,
        "seconds": round(time.time() - start, 1),
    }
    if junit.exists():
        record.update(parse_junit(junit))
    else:
        record.update(no_counts, note="pytest wrote no JUnit XML")
    record["status"] = pytest_status(record, code, timed_out)
    return record


# --------------------------------------------------------------------------- replays


def run_replays(
    env: dict[str, str],
    out: Path,
    replays: Sequence[str],
    timeout: float,
    deadline: float | None = None,
) -> list[dict[str, Any]]:
    """Run each replay (``script.py args``, given to ``python3``) with the bundle's environment.

    Each replay gets ``timeout`` seconds, cut by :func:`time_left` to what ``deadline``
    (a ``time.monotonic()`` value) leaves; one with nothing left is not started and is
    recorded as timed out.
    """
    records = []
    for index, line in enumerate(replays, 1):
        left = time_left(timeout, deadline)
        record: dict[str, Any] = {"command": line, "exit_code": None, "status": TIMED_OUT}
        if left <= 0:
            records.append(_not_started(record))
            continue
        cmd = [sys.executable, *shlex.split(line)]
        start = time.time()
        with (out / f"replay-{index}.log").open("w") as log:
            code, timed_out = _run_logged(cmd, env=env, cwd=Path.cwd(), log=log, timeout=left)
        record.update(
            exit_code=code,
            status=TIMED_OUT if timed_out else PASSED if code == 0 else FAILED,
            seconds=round(time.time() - start, 1),
            log=f"replay-{index}.log",
        )
        records.append(record)
    return records


# --------------------------------------------------------------------------- driver


def _run_logged(
    cmd: Sequence[str], *, env: dict[str, str], cwd: Path, log: Any, timeout: float
) -> tuple[int | None, bool]:
    """Run ``cmd`` with its output to ``log`` and to our stdout; interrupt it at ``timeout``.

    The child finds ``timeout`` in ``VLLM_BUNDLE_TIME_LEFT_S``. At the limit it gets
    SIGINT (pytest then still writes its reports), and SIGKILL :data:`KILL_GRACE_S`
    later. Returns ``(exit code, timed out)``.
    """
    print("$ " + shlex.join(cmd), flush=True)
    log.write("$ " + shlex.join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(
        cmd,
        env={**env, TIME_LEFT_ENV: f"{timeout:.1f}"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )

    def copy() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        log.write(f"\n[device_run] time limit of {timeout:.0f}s reached: SIGINT\n")
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(timeout=READER_JOIN_S)
    return proc.returncode, timed_out


def _write(out: Path, provenance: dict[str, Any], results: dict[str, Any]) -> None:
    """Write ``<out>/results.json``: ``results`` (with its ``ok``) under ``data``."""
    ran = [
        results[k]
        for k in ("install", "smoke", "pytest")
        if results.get(k, {}).get("status") != NOT_RUN
    ]
    ran += results.get("replays", [])
    results["ok"] = bool(ran) and all(r.get("status") == PASSED for r in ran)
    missing = [k for k in REQUIRED if k not in provenance]
    if missing:  # as harness.results.write refuses it
        raise BundleError(f"results.json provenance lacks {missing}")
    record = {"schema": SCHEMA, "kind": KIND, "provenance": provenance, "data": results}
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join([Path(__file__).name, *argv])
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= WRAP_UP_S:
        parser.error(
            f"--time-limit {args.time_limit:g} leaves no step any time: each keeps "
            f"{WRAP_UP_S:.0f} s back to be stopped and recorded; give more than that"
        )
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    bundle = args.bundle.resolve()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    prefix = args.prefix.resolve()
    provenance = json.loads((bundle / "provenance.json").read_text())
    results: dict[str, Any] = {
        "bundle": {
            k: provenance[k] for k in ("base", "series_hash", "tree", "target") if k in provenance
        },
        "install": {"status": NOT_RUN},
        "smoke": {"status": NOT_RUN},
        "pytest": {"status": NOT_RUN},
        "replays": [],
    }
    with (out / "install.log").open("w") as log:
        try:
            results["install"] = install(
                bundle,
                prefix,
                lambda text: log.write(text + "\n"),
                [folder.resolve() for folder in args.wheel_parts],
            )
        except (BundleError, OSError, tarfile.TarError) as exc:
            results["install"] = {"status": FAILED, "error": str(exc)}
            print(f"[device_run] install failed: {exc}", file=sys.stderr)
    installed = results["install"]["status"] == PASSED
    # Without an install, probe the host's own torch (the provenance needs it).
    env = environment(prefix, out, provenance) if installed else dict(os.environ)
    results["host"] = host_provenance(env)
    run_provenance = result_provenance(command, date, provenance, results["host"])
    _write(out, run_provenance, results)
    if not installed:
        return 1

    if not args.skip_smoke:
        results["smoke"] = run_smoke(env, out, time_left(args.smoke_timeout, deadline))
        _write(out, run_provenance, results)
    tests = args.test or provenance["contents"]["tests"]["selected"]
    if tests and not args.skip_tests:
        timeout = time_left(args.pytest_timeout, deadline)
        results["pytest"] = run_pytest(
            env, prefix, out, tests, args.k, args.pytest_arg, timeout=timeout
        )
        _write(out, run_provenance, results)
    results["replays"] = run_replays(env, out, args.replay, args.replay_timeout, deadline)
    _write(out, run_provenance, results)
    _summary(results)
    return 0 if results["ok"] else 1


def _note(record: dict[str, Any]) -> str:
    """A step record's note (why it did not run, or what it lacks), for the summary lines."""
    return f": {record['note']}" if record.get("note") else ""


def _summary(results: dict[str, Any]) -> None:
    host = results.get("host", {})
    print(
        f"\n[device_run] {host.get('gpu', '?')} driver {host.get('driver', '?')} "
        f"torch {host.get('torch', '?')} CUDA {host.get('torch_cuda', '?')} "
        f"python {host.get('python')}"
    )
    print(f"[device_run] install: {results['install']['status']}")
    smoke_record = results["smoke"]
    print(f"[device_run] smoke: {smoke_record['status']}{_note(smoke_record)}")
    for check in smoke_record.get("checks", []):
        print(f"    {check['status']:7} {check['name']}")
    py = results["pytest"]
    if py["status"] == NOT_RUN:
        print("[device_run] pytest: not-run")
    else:
        print(
            f"[device_run] pytest: {py['status']}: {py['passed']} passed, {py['failed']} failed, "
            f"{py['errors']} errors, {py['skipped']} skipped{_note(py)}"
        )
        for skip in py["skipped_tests"]:
            print(f"    SKIPPED {skip['test']}: {skip['reason']}")
        for fail in py["failed_tests"]:
            print(f"    {fail['kind'].upper()} {fail['test']}: {fail['message'][:200]}")
    for replay in results["replays"]:
        print(
            f"[device_run] replay {replay['command']}: {replay['status']} "
            f"(exit {replay['exit_code']}){_note(replay)}"
        )
    print(f"[device_run] ok: {results['ok']}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="device_run.py",
        description="Install a vLLM device bundle on this GPU host, smoke-test its kernels, "
        "run the series' GPU tests and replays, and write results.json.",
    )
    parser.add_argument(
        "--bundle",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="the bundle folder (default: the folder of this script)",
    )
    parser.add_argument(
        "--prefix",
        type=Path,
        default=Path("/tmp/vllm-bundle"),
        help="install here; nothing outside it is written (default /tmp/vllm-bundle)",
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "device-out",
        help="folder for results.json and logs (default $OUT, else ./device-out)",
    )
    parser.add_argument(
        "--test",
        action="append",
        default=[],
        metavar="PATH_OR_NODEID",
        help="run these tests instead of the bundle's selection (repeatable)",
    )
    parser.add_argument(
        "--wheel-parts",
        action="append",
        type=Path,
        default=[],
        metavar="FOLDER",
        help="a folder holding every part of a wheel group (`harness bundle --wheel-group`), "
        "each copied there by an earlier call; joined, checked and installed with the "
        "bundle's wheels (repeatable)",
    )
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more pytest argument (repeatable), e.g. --pytest-arg=-x",
    )
    parser.add_argument(
        "--replay",
        action="append",
        default=[],
        metavar="'SCRIPT.py ARGS'",
        help="a replay command line to run after the tests (repeatable)",
    )
    parser.add_argument("--skip-smoke", action="store_true", help="do not run the smoke check")
    parser.add_argument("--skip-tests", action="store_true", help="do not run pytest")
    parser.add_argument("--smoke-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--pytest-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--replay-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wall-clock budget from the start, which the run ends within: each step's "
        f"timeout is cut to what is left less {WRAP_UP_S:.0f} s (a cut step gets SIGINT, "
        f"then SIGKILL {KILL_GRACE_S:.0f} s later), a step with nothing left is not started "
        "(recorded as timed out), and each child finds its seconds in "
        f"{TIME_LEFT_ENV}; for a device call of L seconds, give L less what the command "
        "does before and after device_run.py (a copy, a tar: about 10 s)",
    )
    return parser


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == SMOKE_CHILD:
        smoke(Path(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == PROBE_CHILD:
        probe()
        sys.exit(0)
    sys.exit(main())
