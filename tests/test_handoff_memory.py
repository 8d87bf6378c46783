"""The hand-off's memory (app/handoff/memory.py) and the server's own memory refused as a region.

A block is anonymous (nothing in /dev/shm, no resource tracker), sealed at its size, all its pages
reserved, and gone with its last mapping; one that does not fit the headroom is refused at once,
naming the size and the remedy; the headroom is read from /proc/meminfo and the memory cgroup (v1
and v2, files laid out as the kernel does in a folder of the test's). The shared-memory extension
refuses an object that is memory of this process: a block claimed by the hand-off, or any file it maps.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from app.handoff import memory
from app.handoff.arena import Arena
from app.protocol import own_memory
from app.protocol.errors import InvalidInput
from app.protocol.shared_memory import SHM_FOLDER, SharedMemoryRegions


def mapped_blocks() -> int:
    return sum(f"/memfd:{memory.NAME} " in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_block_has_no_name_is_sealed_reserved_and_gone_with_its_mappings() -> None:
    before = set(os.listdir(SHM_FOLDER))
    mapped = mapped_blocks()
    front = Arena.create(slots=4, slot_bytes=1 << 16)
    size = Arena.size_of(4, 1 << 16)
    assert set(os.listdir(SHM_FOLDER)) == before  # nothing anyone could list, open or register
    assert mapped_blocks() == mapped + 1
    fd = front.fd
    assert os.fstat(fd).st_blocks * 512 >= size  # every page reserved at creation
    for change in (lambda: os.ftruncate(fd, size // 2), lambda: os.ftruncate(fd, size * 2)):
        with pytest.raises(PermissionError):  # sealed: no side can shrink it under the other's mapping
            change()
    engine = Arena.attach(os.dup(fd), 4, 1 << 16)
    front.handed_over()  # the front keeps its mapping only
    assert front.block.fd is None and engine.block.fd is None
    assert mapped_blocks() == mapped + 2
    slot = front.take()
    assert slot is not None
    front.payload(slot.index, 4)[:] = b"rows"
    assert bytes(engine.payload(slot.index, 4)) == b"rows"  # one memory, two mappings
    engine.close()
    front.close()
    front.close()  # twice: harmless
    assert mapped_blocks() == mapped
    assert set(os.listdir(SHM_FOLDER)) == before


def test_attach_refuses_what_is_not_a_block_of_that_size(tmp_path: Path) -> None:
    arena = Arena.create(slots=2, slot_bytes=64)
    with pytest.raises(ValueError, match="not a"):
        Arena.attach(os.dup(arena.fd), 4, 64)  # more slots than it holds
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, Arena.size_of(2, 64))
    with pytest.raises(ValueError, match="sealed"):
        Arena.attach(unsealed, 2, 64)
    with pytest.raises(OSError, match="Bad file descriptor"):  # attach took the descriptor, and closed it
        os.fstat(unsealed)
    arena.close()


def test_a_block_past_the_headroom_is_refused_at_once_naming_size_and_remedy() -> None:
    room = memory.headroom()
    assert room is not None and room > 0  # /proc/meminfo, on Linux
    with pytest.raises(memory.NoRoom) as refused:
        memory.create(1 << 50, "the test's block")  # 1 PiB
    message = str(refused.value)
    assert message.startswith("no room for the test's block: 1,073,741,824 MiB of shared memory")
    assert "--memory" in message and "resources.limits.memory" in message and "FFN_HANDOFF_SLOTS" in message


def test_an_allocation_the_kernel_refuses_is_no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    mapped = mapped_blocks()
    monkeypatch.setattr(os, "posix_fallocate", refused)
    with pytest.raises(memory.NoRoom, match=r"1 MiB of shared memory \(Cannot allocate memory\)"):
        memory.create(1 << 20, "a block")
    assert mapped_blocks() == mapped


def fake_root(tmp_path: Path, cgroup: str, files: dict[str, str], available_kib: int = 8 << 20) -> Path:
    """A folder laid out as / is for the headroom's reads: /proc/meminfo, /proc/self/cgroup, cgroup files."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: 99 kB\nMemAvailable:   {available_kib} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("cgroup", "files", "room"),
    [
        # v2, the container's cgroup at the mount's root (a cgroup namespace): limit less usage
        ("0::/\n", {"sys/fs/cgroup/memory.max": "1073741824\n", "sys/fs/cgroup/memory.current": "805306368\n"}, 256),
        # v2 without a namespace: the process's own folder
        (
            "0::/kubepods/pod1/c1\n",
            {
                "sys/fs/cgroup/kubepods/pod1/c1/memory.max": "536870912\n",
                "sys/fs/cgroup/kubepods/pod1/c1/memory.current": "268435456\n",
            },
            256,
        ),
        # v2, no limit: the host's available memory (8 GiB here)
        ("0::/\n", {"sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": "1\n"}, 8192),
        # v1 (docker run --memory 512m on an older host)
        (
            "4:memory:/docker/abc\n1:cpu:/\n",
            {
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "536870912\n",
                "sys/fs/cgroup/memory/memory.usage_in_bytes": "402653184\n",
            },
            128,
        ),
        # v1 without a limit (the kernel's largest page-aligned number)
        ("4:memory:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}, 8192),
    ],
)
def test_headroom_is_the_cgroup_limit_less_usage_or_the_available_memory(
    tmp_path: Path, cgroup: str, files: dict[str, str], room: int
) -> None:
    assert memory.headroom(fake_root(tmp_path, cgroup, files)) == room << 20


def test_the_server_s_own_memory_is_never_a_region(tmp_path: Path) -> None:
    """Whatever its name: a block the hand-off claimed, or any file this process maps, is refused."""
    regions = SharedMemoryRegions(folder=tmp_path)
    claimed, mapped, other = (tmp_path / name for name in ("claimed", "mapped", "other"))
    for path in (claimed, mapped, other):
        path.write_bytes(bytes(4096))
    claimed_fd = os.open(claimed, os.O_RDWR)
    identity = own_memory.claim(claimed_fd)
    with open(mapped, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)
    try:
        for key in ("/claimed", "/mapped"):
            with pytest.raises(InvalidInput, match="this server's own memory"):
                regions.register("r", key, 0, 8)
        regions.register("other", "/other", 0, 8)  # a client's object is a region, as before
    finally:
        mapping.close()
        own_memory.release(identity)
        os.close(claimed_fd)
    regions.register("claimed", "/claimed", 0, 8)  # no longer the server's: a region like any
    regions.register("mapped", "/mapped", 0, 8)
    assert sorted(regions.names()) == ["claimed", "mapped", "other"]
    regions.close_all()


def test_a_handoff_block_is_claimed_while_mapped() -> None:
    arena = Arena.create(slots=1, slot_bytes=64)
    info = os.fstat(arena.fd)
    assert own_memory.is_own(info)
    arena.close()
    assert not own_memory.is_own(info)


def test_a_large_slot_takes_pages_only_while_taken_and_gives_them_back_merged() -> None:
    front = Arena.create(slots=2, slot_bytes=64, large_bytes=1 << 20)
    engine = Arena.attach(os.dup(front.fd), 2, 64, 1 << 20)
    try:
        fd = front.fd
        reserved = os.fstat(fd).st_blocks * 512
        assert reserved < 1 << 16  # the slots' pages reserved, not the large area's
        a, b = front.take_large(300_000), front.take_large(100_000)
        assert a is not None and b is not None and a.large and a.place % mmap.PAGESIZE == 0
        assert front.take_large(700_000) is None  # 1 MiB holds no third of that size: the caller's 429
        front.region(a.place, a.room, 300_000)[:] = b"x" * 300_000
        assert os.fstat(fd).st_blocks * 512 >= reserved + 300_000  # its pages taken as written
        assert bytes(engine.region(a.place, a.room, 3)) == b"xxx"  # one memory: the engine reads it in place
        with pytest.raises(ValueError, match="no slot"):  # nothing outside a slot's bounds is read or written
            engine.region(a.place + 16, a.room, 4)
        with pytest.raises(ValueError, match="no slot"):
            engine.region(a.place, a.room + mmap.PAGESIZE * 256, 4)
        with pytest.raises(ValueError, match="no slot"):  # where a third small slot would be: padding
            engine.region(2 * (16 + 64), 64, 4)
        assert bytes(engine.region(16 + 64, 64, 4)) == bytes(engine.payload(1, 4))  # the second small slot
        front.give_back(b)
        front.give_back(a)
        assert os.fstat(fd).st_blocks * 512 <= reserved  # its pages back to the host
        assert front.large_free == 1 << 20
        whole = front.take_large((1 << 20) - 16)  # the freed extents merged into one
        assert whole is not None and whole.place == a.place
    finally:
        engine.close()
        front.close()
