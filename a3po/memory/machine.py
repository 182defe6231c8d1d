"""What the machine can still give a run (a3po.run.memory_check holds the estimate against it): on
a CPU `MemAvailable`, or less where the process's memory cgroup has a limit; on a GPU the free
memory `torch.cuda.mem_get_info` reports. And what a run has taken: the memory/* metrics each step
logs (`process_memory`)."""

from __future__ import annotations

from pathlib import Path

from a3po.memory.parts import GIB, SHARED_MEMORY

__all__ = ["UNLIMITED", "parse_meminfo", "cgroup_room", "host_available", "available_memory", "process_memory", "host_resident"]

UNLIMITED = 2**60  # a cgroup "limit" at or above this is none (v1 writes 2^63 rounded to pages)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes by name."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name.strip()] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return values


def cgroup_room(limit: str, usage: str, stat: str) -> int | None:
    """What a memory cgroup leaves: its limit less what it uses, the reclaimable page cache
    (inactive_file) not counted as used; None where it has no limit. Takes the files' texts:
    v2's memory.max, memory.current, memory.stat, or v1's memory.limit_in_bytes,
    memory.usage_in_bytes, memory.stat."""
    limit = limit.strip()
    if limit in ("", "max") or int(limit) >= UNLIMITED:
        return None
    inactive = 0
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name in ("inactive_file", "total_inactive_file"):
            inactive = max(inactive, int(value))
    return max(0, int(limit) - max(0, int(usage.strip() or 0) - inactive))


def _cgroup_dirs(root: Path = Path("/sys/fs/cgroup")) -> list[tuple[Path, tuple[str, str, str]]]:
    """This process's memory cgroup directories (v2 and v1, the process's own path and the
    namespace's root, where a container sees only that), with the files' names."""
    v2, v1 = ("memory.max", "memory.current", "memory.stat"), ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat")
    dirs: list[tuple[Path, tuple[str, str, str]]] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            dirs += [(root / path.lstrip("/"), v2), (root, v2)]
        elif "memory" in controllers.split(","):
            dirs += [(root / "memory" / path.lstrip("/"), v1), (root / "memory", v1)]
    return dirs


def host_available() -> tuple[int, str]:
    """Bytes this process may still take on the host, and where the figure came from:
    MemAvailable, or less where a memory cgroup limit leaves less."""
    available = parse_meminfo(Path("/proc/meminfo").read_text()).get("MemAvailable")
    where = "MemAvailable in /proc/meminfo"
    if available is None:  # not Linux, or a kernel before 3.14: no check
        return UNLIMITED, "no MemAvailable"
    for directory, names in _cgroup_dirs():
        try:
            texts = [(directory / name).read_text() for name in names]
        except OSError:
            continue
        room = cgroup_room(*texts)
        if room is not None and room < available:
            available, where = room, f"the memory cgroup's limit less its use ({directory / names[0]})"
    return available, where


def available_memory(device: str) -> tuple[int, str]:
    """What `device` ("cpu", "cuda:0") can still give this run, and where the figure came from."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"torch.cuda.mem_get_info({device!r}) free"
    if device == SHARED_MEMORY:
        return shared_memory_free()
    return host_available()


def shared_memory_free(path: str = SHARED_MEMORY) -> tuple[int, str]:
    """The free space of the tmpfs that torch.multiprocessing's shared tensors live in."""
    import os

    try:
        stat = os.statvfs(path)
    except OSError as err:
        return 0, f"{path} unreadable ({err.strerror})"
    return stat.f_bavail * stat.f_frsize, f"{path} free (statvfs)"


def process_memory(device: str = "cpu", status_text: str | None = None) -> dict[str, float]:
    """The memory/* metrics (a3po.metrics), in GiB: this process's resident memory and its peak
    (VmRSS, VmHWM of /proc/self/status, or `status_text`); on a CUDA `device`, torch's peak
    allocation since the process started and its allocator's reservation. Empty where there is
    no /proc (not Linux). Reading them changes nothing: no peak is reset."""
    status_text = _own_status() if status_text is None else status_text
    if status_text is None:
        return {}
    status = parse_meminfo(status_text)
    if "VmRSS" not in status or "VmHWM" not in status:
        return {}
    figures = {"memory/host_rss": status["VmRSS"] / GIB, "memory/host_peak": status["VmHWM"] / GIB}
    if device.startswith("cuda"):
        import torch

        figures["memory/cuda_peak"] = torch.cuda.max_memory_allocated(device) / GIB
        figures["memory/cuda_reserved"] = torch.cuda.memory_reserved(device) / GIB
    return figures


def host_resident(status_text: str | None = None) -> int | None:
    """This process's resident memory in bytes (VmRSS of /proc/self/status, or `status_text`);
    None where there is no /proc (not Linux)."""
    status_text = _own_status() if status_text is None else status_text
    return None if status_text is None else parse_meminfo(status_text).get("VmRSS")


def _own_status() -> str | None:
    """/proc/self/status, or None where there is none (not Linux)."""
    try:
        return Path("/proc/self/status").read_text()
    except OSError:
        return None
