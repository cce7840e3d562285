"""A step's input tensors in one host-to-device copy.

The step's host description (token ids, positions, slots, block table, ...) is written
section by section into one byte buffer on the host, copied to the device in ONE copy, and
handed out as typed views of the device buffer. On a GPU the host side is pinned memory
(two of them, used in turn, so filling step n+1 never races step n's copy) and the copy is
non-blocking; the device side is either fresh per step or, for the graph-captured target
forward (rocdraft/engine/target_graphs.py), the runner's persistent buffer, whose views sit
at the same addresses every time the same layout comes back.

Layout: sections in the order given, each starting at a multiple of ``ALIGN`` bytes, so a
byte offset is valid for every dtype's view. The layout depends only on the sections'
names, dtypes and shapes; a captured graph's inputs therefore keep their addresses.

Example: sections ("ids", int64, (3,)), ("seq_lens", int32, (2,)), ("mask", bool, (2, 2)):
ids at bytes 0..23, seq_lens at 32..39, mask at 48..51; 52 bytes copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16  # bytes; every section starts at a multiple of this


@dataclass(frozen=True)
class Section:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def section_offsets(sections: list[Section]) -> tuple[list[int], int]:
    """-> (byte offset of each section, bytes used). Pure; see the module example."""
    offsets, end = [], 0
    for section in sections:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + section.nbytes
    return offsets, end


def typed_views(buffer: torch.Tensor, sections: list[Section], offsets: list[int]
                ) -> dict[str, torch.Tensor]:
    """Views of the uint8 ``buffer``, one per section, with its dtype and shape."""
    return {s.name: buffer[o:o + s.nbytes].view(s.dtype).view(s.shape)
            for s, o in zip(sections, offsets)}


class StepInputBuffers:
    """Host staging and (optionally persistent) device memory for a step's inputs.

    ``upload(values, persistent)``: values name -> host tensor (any dtype/shape) -> name ->
    device view, after exactly one host-to-device copy (none on the CPU: a fresh upload
    returns the host tensors themselves, a persistent one fills the buffer directly).
    ``persistent=True`` writes into the buffer this object owns
    (the graph runner's static inputs; they are overwritten by the next persistent upload),
    else into fresh device memory that the step's tensors own alone."""

    def __init__(self, device: torch.device | str, persistent_bytes: int = 0) -> None:
        """``persistent_bytes``: the size of the persistent device buffer, fixed for this
        object's life (captured graphs keep pointers into it)."""
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.persistent = torch.zeros(persistent_bytes, dtype=torch.uint8, device=self.device)
        self._staging: list[torch.Tensor] = []
        self._copied: list = [None, None]  # the event after each staging buffer's last copy
        self._turn = 0  # which pinned staging buffer the next upload fills
        self.num_uploads = 0  # uploads made: one per step (tests read it)

    def _staging_for(self, used: int) -> torch.Tensor:
        """The pinned staging buffer of this turn, at least ``used`` bytes (grown by
        doubling; a replaced buffer's in-flight copy keeps it alive in torch's pinned
        allocator)."""
        if not self._staging or self._staging[0].numel() < used:
            size = max(used, 2 * (self._staging[0].numel() if self._staging else 1 << 12))
            self._staging = [torch.zeros(size, dtype=torch.uint8).pin_memory()
                             for _ in range(2)]
            self._copied = [None, None]
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # the copy of two uploads ago (long done)
        return self._staging[self._turn]

    def upload(self, values: dict[str, torch.Tensor], persistent: bool = False
               ) -> dict[str, torch.Tensor]:
        sections = [Section(name, t.dtype, tuple(t.shape)) for name, t in values.items()]
        offsets, used = section_offsets(sections)
        if persistent and used > self.persistent.numel():
            raise ValueError(f"step inputs of {used} bytes exceed the persistent buffer of "
                             f"{self.persistent.numel()} bytes (sized at construction)")
        self.num_uploads += 1
        if not self.on_gpu:  # the CPU: the "device" is host memory
            if not persistent:
                return dict(values)  # the host tensors themselves: nothing to copy
            _fill(self.persistent, values, sections, offsets)
            return typed_views(self.persistent, sections, offsets)
        staging = self._staging_for(used)
        _fill(staging, values, sections, offsets)
        target = self.persistent if persistent else torch.empty(used, dtype=torch.uint8,
                                                                 device=self.device)
        target[:used].copy_(staging[:used], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event
        self._turn ^= 1
        return typed_views(target, sections, offsets)


def _fill(buffer: torch.Tensor, values: dict[str, torch.Tensor], sections: list[Section],
          offsets: list[int]) -> None:
    views = typed_views(buffer, sections, offsets)
    for section in sections:
        views[section.name].copy_(values[section.name])
