"""Prune the CUDA device code inside a host shared library to one GPU architecture.

A CUDA extension such as vLLM's ``_C_stable_libtorch.abi3.so`` keeps its device
code in the ELF section ``.nv_fatbin``: a sequence of *fatbin blobs*, one per
compiled ``.cu`` file, each holding several *images* (a cubin, i.e. SASS for
one ``sm_XY``, or PTX for one ``compute_XY``). At module load the CUDA driver
reads the image headers of a blob and picks one image for the GPU it runs on:

* a cubin whose architecture has the GPU's major version and a minor version
  no higher than the GPU's (an ``sm_90`` or ``sm_90a`` cubin on an H200);
* otherwise the highest PTX whose architecture is no higher than the GPU's,
  which it JIT-compiles (vLLM 0.33.0's Marlin MoE kernels reach sm_90 only as
  ``compute_80`` PTX).

Every other image is dead weight on that GPU. :func:`prune` overwrites the
payload bytes of those images with zeros and leaves every header, offset and
the file size as they were, so the library links and loads exactly as before
and the driver sees the same choice; but the zeroed ranges compress to almost
nothing, which is what lets the two libraries travel in the 64 MiB a device
call may carry (see ``docs/device-bundle.md``).

The pruned library only works on the architecture it was pruned for, and
``CUDA_FORCE_PTX_JIT=1`` must not be set (it would ask for PTX that was zeroed
where a cubin was kept).

Layouts (little-endian; offsets in bytes):

* blob header, 16 bytes: ``u32 magic (0xBA55ED50) | u16 version |
  u16 header size | u64 size of the images that follow``;
* image header (``header size`` bytes, at least 48): ``u16 kind (1 = PTX,
  2 = cubin) | u16 version | u32 header size | u64 payload size | ... |
  u32 architecture at 28 | ... | u64 flags at 40``; the payload follows the
  header.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from harness.project import HarnessError

FATBIN_SECTION = ".nv_fatbin"
BLOB_MAGIC = 0xBA55ED50
BLOB_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, images size
IMAGE_HEADER = struct.Struct("<HHIQ")  # kind, version, header size, payload size
IMAGE_ARCH_OFFSET = 28
IMAGE_FLAGS_OFFSET = 40
IMAGE_MIN_HEADER = 48
KIND_PTX = 1
KIND_CUBIN = 2

_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_ELF_SECTION = struct.Struct("<IIQQQQIIQQ")


@dataclasses.dataclass(frozen=True)
class Image:
    """One device image of a fatbin blob, located in the library file."""

    blob: int  # file offset of the blob header the image belongs to
    offset: int  # file offset of the image header
    kind: int
    arch: int  # e.g. 90 for sm_90 / compute_90
    header_size: int
    payload_size: int
    flags: int

    @property
    def payload(self) -> slice:
        """The file range of the image's payload."""
        start = self.offset + self.header_size
        return slice(start, start + self.payload_size)

    @property
    def label(self) -> str:
        if self.kind == KIND_CUBIN:
            return f"sm_{self.arch} cubin"
        if self.kind == KIND_PTX:
            return f"compute_{self.arch} ptx"
        return f"kind {self.kind} arch {self.arch}"


@dataclasses.dataclass(frozen=True)
class PruneReport:
    """What :func:`prune` kept and zeroed, in payload bytes and image counts."""

    target_sm: int
    kept_bytes: int
    zeroed_bytes: int
    kept_images: int
    zeroed_images: int
    blobs: int
    blobs_without_target: int  # blobs with no image the target can load

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def fatbin_section(data: bytes | bytearray) -> tuple[int, int]:
    """Return ``(file offset, size)`` of the ``.nv_fatbin`` section of an ELF64 file."""
    if len(data) < _ELF_HEADER.size or data[:4] != b"\x7fELF":
        raise HarnessError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise HarnessError("only little-endian ELF64 libraries are supported")
    fields = _ELF_HEADER.unpack_from(data, 0)
    shoff, shentsize, shnum, shstrndx = fields[6], fields[11], fields[12], fields[13]
    if shoff == 0 or shentsize < _ELF_SECTION.size or shstrndx >= shnum:
        raise HarnessError("the ELF file has no usable section header table")

    def section(index: int) -> tuple[int, ...]:
        return _ELF_SECTION.unpack_from(data, shoff + index * shentsize)

    names_offset = section(shstrndx)[4]
    for index in range(shnum):
        name_index, _type, _flags, _addr, offset, size, *_ = section(index)
        start = names_offset + name_index
        end = data.index(b"\0", start)
        if bytes(data[start:end]).decode(errors="replace") == FATBIN_SECTION:
            return offset, size
    raise HarnessError(f"no {FATBIN_SECTION} section: not a CUDA library")


def has_fatbin(path: Path) -> bool:
    """Whether ``path`` is an ELF64 library with a ``.nv_fatbin`` section."""
    try:
        fatbin_section(path.read_bytes())
    except HarnessError:
        return False
    return True


def images(data: bytes | bytearray) -> list[Image]:
    """Every device image in the ``.nv_fatbin`` section of ``data``, in file order."""
    start, size = fatbin_section(data)
    end = start + size
    found: list[Image] = []
    pos = start
    while pos + BLOB_HEADER.size <= end:
        magic, _version, header_size, images_size = BLOB_HEADER.unpack_from(data, pos)
        if magic != BLOB_MAGIC:
            pos += 8  # blobs are 8-byte aligned; skip padding between them
            continue
        blob = pos
        cursor, blob_end = pos + header_size, pos + header_size + images_size
        if blob_end > end:
            raise HarnessError(f"fatbin blob at {blob:#x} runs past the section end")
        while cursor + IMAGE_HEADER.size <= blob_end:
            kind, _v, image_header, payload = IMAGE_HEADER.unpack_from(data, cursor)
            if image_header == 0:
                break
            if image_header < IMAGE_MIN_HEADER or cursor + image_header + payload > blob_end:
                raise HarnessError(f"malformed fatbin image header at {cursor:#x}")
            (arch,) = struct.unpack_from("<I", data, cursor + IMAGE_ARCH_OFFSET)
            (flags,) = struct.unpack_from("<Q", data, cursor + IMAGE_FLAGS_OFFSET)
            found.append(Image(blob, cursor, kind, arch, image_header, payload, flags))
            cursor += image_header + payload
        pos = blob_end
    return found


def loadable(blob_images: Sequence[Image], target_sm: int) -> list[Image]:
    """The images of one blob the driver can use on ``sm_<target_sm>``.

    Cubins of the target's major version with a minor version no higher than
    the target's, if the blob has any; otherwise the highest PTX no higher
    than the target (JIT-compiled at load); otherwise nothing.
    """
    major = target_sm // 10
    cubins = [
        i
        for i in blob_images
        if i.kind == KIND_CUBIN and i.arch // 10 == major and i.arch <= target_sm
    ]
    if cubins:
        return cubins
    ptx = [i for i in blob_images if i.kind == KIND_PTX and i.arch <= target_sm]
    if not ptx:
        return []
    best = max(i.arch for i in ptx)
    return [i for i in ptx if i.arch == best]


def _by_blob(found: Iterable[Image]) -> dict[int, list[Image]]:
    blobs: dict[int, list[Image]] = {}
    for image in found:
        blobs.setdefault(image.blob, []).append(image)
    return blobs


def prune_bytes(data: bytearray, target_sm: int) -> PruneReport:
    """Zero, in place, the payload of every image ``sm_<target_sm>`` will not load."""
    if not 10 <= target_sm <= 999:
        raise HarnessError(f"target architecture {target_sm} is not of the form 90, 100, ...")
    blobs = _by_blob(images(data))
    if not blobs:
        raise HarnessError(f"the {FATBIN_SECTION} section holds no fatbin blobs")
    kept = zeroed = kept_n = zeroed_n = empty = 0
    for blob_images in blobs.values():
        keep = {i.offset for i in loadable(blob_images, target_sm)}
        empty += not keep
        for image in blob_images:
            if image.offset in keep:
                kept += image.payload_size
                kept_n += 1
            else:
                data[image.payload] = bytes(image.payload_size)
                zeroed += image.payload_size
                zeroed_n += 1
    return PruneReport(target_sm, kept, zeroed, kept_n, zeroed_n, len(blobs), empty)


def prune(source: Path, dest: Path, target_sm: int) -> PruneReport:
    """Write ``source`` to ``dest`` with every image ``sm_<target_sm>`` will not load zeroed.

    Raises:
        HarnessError: ``source`` is not an ELF64 CUDA library, or nothing in it
            can run on the target (every blob would be emptied).
    """
    data = bytearray(source.read_bytes())
    try:
        report = prune_bytes(data, target_sm)
    except HarnessError as exc:
        raise HarnessError(f"cannot prune {source}: {exc}") from exc
    if report.kept_images == 0:
        raise HarnessError(f"{source} has no device code for sm_{target_sm}; refusing to prune")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return report


def summary(data: bytes | bytearray) -> dict[str, tuple[int, int]]:
    """``{"sm_90 cubin": (images, payload bytes), ...}`` for a library's fatbin."""
    stats: dict[str, tuple[int, int]] = {}
    for image in images(data):
        count, size = stats.get(image.label, (0, 0))
        stats[image.label] = (count + 1, size + image.payload_size)
    return dict(sorted(stats.items()))
