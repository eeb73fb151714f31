#!/usr/bin/env python3
"""What the CUDA driver allows with one physical allocation, on GPU 0 (docs/expandable.md,
"What the driver allows"): mapping part of it, unmapping part of a mapping, mapping all of it at
a second virtual range, and what the driver calls of a growth cost; then a chunk made of one
physical allocation per page with one access call over them all: whether one unmap covers
several of its pages, whether its last pages can go back alone, and what each call costs.
Needs only `libcuda`.

    python3 tools/vmm_probe.py
"""
import ctypes as C
import time

cu = C.CDLL("libcuda.so.1")
MIB = 1 << 20


class Location(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [("compression_type", C.c_ubyte), ("gpu_direct_rdma_capable", C.c_ubyte),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class AllocProp(C.Structure):
    _fields_ = [("type", C.c_int), ("requested_handle_types", C.c_int), ("location", Location),
                ("win32_metadata", C.c_void_p), ("alloc_flags", AllocFlags)]


class AccessDesc(C.Structure):
    _fields_ = [("location", Location), ("flags", C.c_int)]


PINNED, ON_DEVICE, READ_WRITE = 1, 1, 3
PROP = AllocProp(type=PINNED, location=Location(ON_DEVICE, 0))
ACCESS = AccessDesc(Location(ON_DEVICE, 0), READ_WRITE)


def check(result, what):
    if result != 0:
        name = C.c_char_p()
        cu.cuGetErrorString(result, C.byref(name))
        raise SystemExit(f"{what}: error {result} ({name.value.decode()})")


def init():
    check(cu.cuInit(0), "cuInit")
    version = C.c_int()
    check(cu.cuDriverGetVersion(C.byref(version)), "cuDriverGetVersion")
    print(f"CUDA driver API {version.value // 1000}.{version.value % 1000 // 10}")
    dev, ctx = C.c_int(), C.c_void_p()
    check(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    gran = C.c_size_t()
    check(cu.cuMemGetAllocationGranularity(C.byref(gran), C.byref(PROP), 0), "granularity")
    return gran.value


def mib(n):
    return f"{n / MIB:.2f} MiB"


def free_bytes():
    free, total = C.c_size_t(), C.c_size_t()
    check(cu.cuMemGetInfo_v2(C.byref(free), C.byref(total)), "cuMemGetInfo")
    return free.value


RESERVED = []


def reserve(size):
    va = C.c_uint64()
    check(cu.cuMemAddressReserve(C.byref(va), C.c_size_t(size), C.c_size_t(0), C.c_uint64(0),
                                 C.c_ulonglong(0)), "cuMemAddressReserve")
    RESERVED.append((va.value, size))
    return va.value


def free_ranges():
    for va, size in RESERVED:
        check(cu.cuMemAddressFree(C.c_uint64(va), C.c_size_t(size)), "cuMemAddressFree")
    RESERVED.clear()


def create(size):
    handle = C.c_ulonglong()
    check(cu.cuMemCreate(C.byref(handle), C.c_size_t(size), C.byref(PROP), C.c_ulonglong(0)),
          "cuMemCreate")
    return handle.value


def try_map(va, size, offset, handle):
    """The driver's answer to mapping `size` bytes of `handle` from `offset` at `va`; a map
    that succeeds is undone at once."""
    result = cu.cuMemMap(C.c_uint64(va), C.c_size_t(size), C.c_size_t(offset),
                         C.c_ulonglong(handle), C.c_ulonglong(0))
    if result == 0:
        unmap(va, size)
    return result


def map_rw(va, size, handle):
    check(cu.cuMemMap(C.c_uint64(va), C.c_size_t(size), C.c_size_t(0), C.c_ulonglong(handle),
                      C.c_ulonglong(0)), "cuMemMap")
    check(cu.cuMemSetAccess(C.c_uint64(va), C.c_size_t(size), C.byref(ACCESS), C.c_size_t(1)),
          "cuMemSetAccess")


def unmap(va, size):
    check(cu.cuMemUnmap(C.c_uint64(va), C.c_size_t(size)), "cuMemUnmap")


def release(handle):
    check(cu.cuMemRelease(C.c_ulonglong(handle)), "cuMemRelease")


def write_page(va, page, value):
    data = (C.c_ubyte * page)(*([value] * page))
    check(cu.cuMemcpyHtoD_v2(C.c_uint64(va), data, C.c_size_t(page)), "cuMemcpyHtoD")


def page_holds(va, page, value):
    out = (C.c_ubyte * page)()
    check(cu.cuMemcpyDtoH_v2(out, C.c_uint64(va), C.c_size_t(page)), "cuMemcpyDtoH")
    return all(b == value for b in bytes(out))


def probe_aliasing(page):
    chunk = 20 * page
    start = free_bytes()
    handle = create(chunk)
    first = reserve(chunk)
    map_rw(first, chunk, handle)
    print(f"a {mib(chunk)} allocation mapped: {mib(start - free_bytes())} taken")
    print("map part of it by offset:", try_map(reserve(chunk), 15 * page, 5 * page, handle))
    print("map its first pages only:", try_map(reserve(chunk), 15 * page, 0, handle))
    print("unmap part of its mapping:",
          cu.cuMemUnmap(C.c_uint64(first + 5 * page), C.c_size_t(15 * page)))
    before = free_bytes()
    second = reserve(chunk)
    map_rw(second, chunk, handle)
    print(f"all of it mapped at a second range: {mib(before - free_bytes())} more taken")
    write_page(second + 8 * page, page, 7)
    print("a write through the second range read through the first:",
          page_holds(first + 8 * page, page, 7))
    unmap(first, chunk)
    release(handle)
    print(f"first range unmapped, handle released: {mib(start - free_bytes())} still taken, "
          f"bytes kept: {page_holds(second + 8 * page, page, 7)}")
    unmap(second, chunk)
    print(f"second range unmapped: {mib(start - free_bytes())} still taken")


def mean_us(fn, n=200):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def probe_costs(page):
    chunk = 20 * page
    at = reserve(chunk)

    def growth(size):
        handle = create(size)
        map_rw(at, size, handle)
        unmap(at, size)
        release(handle)

    for size in (page, 10 * page, chunk):
        us = mean_us(lambda: growth(size))
        print(f"create + map + access + unmap + release of {size // MIB} MiB: {us:.1f} us")
    held = create(chunk)
    home = reserve(chunk)
    map_rw(home, chunk, held)

    def second_mapping():
        map_rw(at, chunk, held)
        unmap(at, chunk)

    us = mean_us(second_mapping)
    print(f"map + access + unmap of an allocation already mapped ({chunk // MIB} MiB): {us:.1f} us")
    unmap(home, chunk)
    release(held)


def set_access(va, size):
    check(cu.cuMemSetAccess(C.c_uint64(va), C.c_size_t(size), C.byref(ACCESS), C.c_size_t(1)),
          "cuMemSetAccess")


def map_pages(at, handles, page):
    for i, h in enumerate(handles):
        check(cu.cuMemMap(C.c_uint64(at + i * page), C.c_size_t(page), C.c_size_t(0),
                          C.c_ulonglong(h), C.c_ulonglong(0)), "cuMemMap")


def probe_paged_chunk(page):
    """A chunk of `n` pages, each its own physical allocation, with one access call."""
    n = 20
    chunk = n * page
    at = reserve(chunk)
    start = free_bytes()
    handles = [create(page) for _ in range(n)]
    map_pages(at, handles, page)
    set_access(at, chunk)
    write_page(at, page, 3)
    write_page(at + (n - 1) * page, page, 4)
    print(f"{n} pages mapped side by side, one access call over them: readable "
          f"{page_holds(at, page, 3) and page_holds(at + (n - 1) * page, page, 4)}")
    tail = 5
    result = cu.cuMemUnmap(C.c_uint64(at + (n - tail) * page), C.c_size_t(tail * page))
    print(f"one unmap over its last {tail} pages: {result}")
    kept = n
    if result == 0:
        for h in handles[n - tail:]:
            release(h)
        print(f"  released: {mib(start - free_bytes())} still taken; first page kept: "
              f"{page_holds(at, page, 3)}")
        handles = handles[:n - tail]
        kept = n - tail
    unmap(at, kept * page)
    print(f"one unmap over the other {kept}: 0" if kept < n else f"one unmap over all {n}: 0")
    for h in handles:
        release(h)

    def paged():
        hs = [create(page) for _ in range(n)]
        map_pages(at, hs, page)
        set_access(at, chunk)
        unmap(at, chunk)
        for h in hs:
            release(h)

    def whole():
        h = create(chunk)
        map_rw(at, chunk, h)
        unmap(at, chunk)
        release(h)

    for name, fn in (("one allocation", whole), ("one allocation per page", paged)):
        print(f"{chunk // MIB} MiB as {name}, mapped, made accessible, unmapped and released: "
              f"{mean_us(fn, 100):.1f} us")
    for _ in range(5):
        costs = whole_costs(at, chunk)
        print(f"one timed call each, one {chunk // MIB} MiB allocation: "
              + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items()))
        costs = call_costs(at, page)
        print("one timed call each (per page: the mean over the pages), one allocation per page: "
              + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items()))


def call_costs(at, page, n=20):
    """The cost of each driver call of one paged chunk of `n` pages at `at`."""
    chunk = n * page
    calls = {}
    hs = []
    calls["create (per page)"] = mean_us(lambda: hs.append(create(page)), n)
    t = time.perf_counter()
    map_pages(at, hs, page)
    calls["map (per page)"] = (time.perf_counter() - t) / n * 1e6
    calls["access (whole chunk)"] = mean_us(lambda: set_access(at, chunk), 1)
    calls["unmap (whole chunk)"] = mean_us(lambda: unmap(at, chunk), 1)
    t = time.perf_counter()
    for h in hs:
        release(h)
    calls["release (per page)"] = (time.perf_counter() - t) / n * 1e6
    return calls


def whole_costs(at, size):
    """The cost of each driver call of one chunk of `size` bytes, one allocation, at `at`."""
    calls = {}
    hs = []
    calls["create"] = mean_us(lambda: hs.append(create(size)), 1)
    calls["map"] = mean_us(lambda: check(cu.cuMemMap(C.c_uint64(at), C.c_size_t(size),
                                                     C.c_size_t(0), C.c_ulonglong(hs[0]),
                                                     C.c_ulonglong(0)), "cuMemMap"), 1)
    calls["access"] = mean_us(lambda: set_access(at, size), 1)
    calls["unmap"] = mean_us(lambda: unmap(at, size), 1)
    calls["release"] = mean_us(lambda: release(hs[0]), 1)
    return calls


def main():
    page = init()
    print(f"granularity {page // MIB} MiB")
    probe_aliasing(page)
    probe_costs(page)
    probe_paged_chunk(page)
    free_ranges()


if __name__ == "__main__":
    main()
