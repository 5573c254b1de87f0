"""Registers, spills and blocks per SM of Marlin MoE kernels, from ptxas reports.

``python -m harness kernels --ptxas-verbose`` writes the ``-Xptxas -v`` report
of every generated kernel unit to ``<out>/build-<namespace>/kernels.log``.
:func:`parse` turns such a log into one :class:`Kernel` per instantiation of
``Marlin<...>``, keyed by a label that names the weight format, tile and B
addressing form; :func:`compare` lines two builds up and lists the
instantiations whose blocks per SM differ.

Blocks per SM are those that ``determine_exec_config`` of vLLM 0.33.0 and
0.34.0 (``csrc/moe/marlin_moe_wna16/ops.cu``, the same rule in both) derives
from the register count when the op picks the tile itself::

    min(255 * 1024 // (regs * num_threads * 4), cap),  cap = 4 if m_blocks == 1 else 2

(at least 1; before the shared-memory and problem-size limits, which do not
depend on the build). Standard library only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

DEVICE_MAX_REG_SIZE = 255 * 1024

#: vLLM ScalarType ids (``vllm.scalar_type``) of the types Marlin MoE uses.
SCALAR_TYPES: dict[int, str] = {
    1125899906910725: "f16",
    1125899906909960: "bf16",
    562949953487106: "fe2m1f",
    2814749767172868: "fe4m3fn",
    2814749767106568: "fe8m0fnu",
    1125899906843648: "u4",
    1125899907892224: "u4b8",
    1125899923621888: "u8b128",
    1125899906909952: "s8",
    1125899906844672: "u8",
}

_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
# Itanium mangling of Marlin<a, b, c, s, threads, m_blocks, n_blocks, k_blocks,
# m_block_size_8, stages, group_blocks, is_zp_float[, b_64bit_offsets]>;
# negative numbers are written with an "n" prefix (Lin1E is -1).
_TEMPLATE = re.compile(
    r"6MarlinILl(\d+)ELl(\d+)ELl(\d+)ELl(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)"
    r"ELb(\d)ELi(\d+)ELi(n?\d+)ELb(\d)E(?:Lb(\d)E)?E"
)
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def blocks_per_sm(regs: int, threads: int, m_blocks: int) -> int:
    """``determine_exec_config``'s register limit on blocks per SM, with its cap."""
    allow = DEVICE_MAX_REG_SIZE // (max(regs, 1) * threads * 4)
    return max(min(allow, 4 if m_blocks == 1 else 2), 1)


def type_name(type_id: int) -> str:
    """Short name of a ScalarType id (``bf16``, ``u4b8``...), else the id itself."""
    return SCALAR_TYPES.get(type_id, str(type_id))


@dataclasses.dataclass
class Kernel:
    """One ``Marlin<...>`` instantiation and what ptxas reported for it."""

    a_type: str
    b_type: str
    c_type: str
    s_type: str
    threads: int
    m_blocks: int
    thread_n: int
    thread_k: int
    m_block_size_8: bool
    stages: int
    group_blocks: int
    is_zp_float: bool
    b_64bit_offsets: bool | None  # None: a tree without that template parameter
    registers: int = -1
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0

    @property
    def blocks_per_sm(self) -> int:
        return blocks_per_sm(self.registers, self.threads, self.m_blocks)

    @property
    def label(self) -> str:
        """``bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8`` (``b64`` for the 64-bit form)."""
        types = f"{self.a_type}.{self.b_type}.{self.s_type}"
        if self.c_type != self.a_type:
            types += f".c{self.c_type}"
        parts = [
            types,
            f"g{self.group_blocks}",
            f"t{self.threads}",
            f"m{self.m_blocks}",
            f"k{self.thread_k}",
            f"n{self.thread_n}",
        ]
        if self.m_block_size_8:
            parts.append("m8")
        if self.stages != 4:
            parts.append(f"s{self.stages}")
        if self.is_zp_float:
            parts.append("zpf")
        if self.b_64bit_offsets:
            parts.append("b64")
        return " ".join(parts)

    @property
    def label_32bit(self) -> str:
        """The label of the same tile in its 32-bit form (equal to :attr:`label` there)."""
        return self.label.removesuffix(" b64")

    def as_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["blocks_per_sm"] = self.blocks_per_sm
        return data


def parse_text(text: str) -> dict[str, Kernel]:
    """Label -> kernel for every Marlin instantiation in a ptxas ``-v`` report."""
    kernels: dict[str, Kernel] = {}
    current: Kernel | None = None
    for line in text.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            match = _TEMPLATE.search(entry.group(1))
            if match is None:
                current = None
                continue
            g = match.groups()
            current = Kernel(
                a_type=type_name(int(g[0])),
                b_type=type_name(int(g[1])),
                c_type=type_name(int(g[2])),
                s_type=type_name(int(g[3])),
                threads=int(g[4]),
                m_blocks=int(g[5]),
                thread_n=16 * int(g[6]),
                thread_k=16 * int(g[7]),
                m_block_size_8=g[8] == "1",
                stages=int(g[9]),
                group_blocks=-int(g[10][1:]) if g[10].startswith("n") else int(g[10]),
                is_zp_float=g[11] == "1",
                b_64bit_offsets=None if g[12] is None else g[12] == "1",
            )
            kernels[current.label] = current
            continue
        if current is None:
            continue
        spill = _SPILL.search(line)
        if spill:
            current.spill_store_bytes = int(spill.group(1))
            current.spill_load_bytes = int(spill.group(2))
        regs = _REGS.search(line)
        if regs:
            current.registers = int(regs.group(1))
    missing = [label for label, k in kernels.items() if k.registers < 0]
    if missing:
        raise ValueError(f"no register count for {len(missing)} kernels, e.g. {missing[0]}")
    return kernels


def parse(log: Path) -> dict[str, Kernel]:
    """:func:`parse_text` of a log file."""
    return parse_text(log.read_text(errors="replace"))


@dataclasses.dataclass
class Comparison:
    """Two builds' kernels lined up by their 32-bit label."""

    reference: Mapping[str, Kernel]
    other: Mapping[str, Kernel]

    @property
    def common(self) -> list[str]:
        return sorted(set(self.reference) & set(self.other))

    @property
    def only_reference(self) -> list[str]:
        return sorted(set(self.reference) - set(self.other))

    @property
    def only_other(self) -> list[str]:
        return sorted(set(self.other) - set(self.reference))

    def blocks_per_sm_changed(self) -> list[str]:
        """Labels present in both whose blocks per SM differ."""
        return [
            label
            for label in self.common
            if self.reference[label].blocks_per_sm != self.other[label].blocks_per_sm
        ]

    def registers_changed(self) -> list[str]:
        return [
            label
            for label in self.common
            if self.reference[label].registers != self.other[label].registers
        ]


def compare(reference: Mapping[str, Kernel], other: Mapping[str, Kernel]) -> Comparison:
    """Line ``other`` up with ``reference``.

    Kernels of a tree without the ``b_64bit_offsets`` parameter and the 32-bit
    form of a tree with it carry the same label, so stock and fixed builds
    compare tile by tile; the fixed build's ``b64`` kernels are extra
    (:attr:`Comparison.only_other`).
    """
    return Comparison(reference, other)


def table_rows(builds: Mapping[str, Mapping[str, Kernel]]) -> Iterable[list[str]]:
    """Markdown table rows: one per label of the first build, then extra labels."""
    names = list(builds)
    labels: list[str] = []
    for table in builds.values():
        labels += [label for label in sorted(table) if label not in labels]
    for label in labels:
        cells = [label]
        for name in names:
            k = builds[name].get(label)
            cells.append(
                "-"
                if k is None
                else f"{k.registers} / {k.spill_store_bytes}/{k.spill_load_bytes}"
                f" / {k.blocks_per_sm}"
            )
        yield cells


_SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")


def sass_functions(text: str) -> dict[str, list[str]]:
    """Label -> SASS lines (instructions and encodings) from ``cuobjdump -sass``.

    Only ``Marlin<...>`` functions are kept, keyed like :func:`parse_text`, so
    the same tile of two builds (other op namespaces, with or without the
    ``b_64bit_offsets`` parameter) lines up. Lines naming a symbol are dropped
    (none occur in these kernels' bodies, which call nothing); the rest is
    compared as it stands, addresses and encodings included.
    """
    functions: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        name = _SASS_FUNCTION.match(line)
        if name:
            current = None
            kernels = parse_text(f"Compiling entry function '{name.group(1)}'\nUsed 0 registers\n")
            if kernels:
                (label,) = kernels
                current = functions.setdefault(label, [])
            continue
        if current is None or not line.strip():
            continue
        if line.strip().startswith(
            (
                "Fatbin",
                "=====",
                "arch =",
                "code version",
                "host =",
                "compile_size",
                "code for",
                ".target",
                ".headerflags",
            )
        ):
            continue
        if "_ZN" in line:
            continue
        current.append(line.strip())
    return functions


def sass_differences(
    reference: Mapping[str, list[str]], other: Mapping[str, list[str]]
) -> dict[str, bool]:
    """For every label in both: True when the SASS is identical."""
    return {
        label: reference[label] == other[label] for label in sorted(set(reference) & set(other))
    }
