"""ferry.ray against a real local Ray cluster (``ray.init()`` here), modelled
on Ray's own RDT tests for NIXL (python/ray/tests/rdt/test_rdt_nixl.py).

Tensors are torch tensors where torch is installed (host, and CUDA where a
GPU is), numpy arrays elsewhere: ``ferry.ray.register()`` picks the type Ray
pulls out of returned values. Every test runs over shared memory and tcp
(the actors' ``FERRY_TRANSPORT``), and checks the receiver's ferry counters
so a value that reached it through Ray's object store instead fails.
Skips (with the reason) only where Ray >= 2.60 is not installed.
"""

import os
import signal
import sys
import time

import numpy
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.60')")
try:
    from ray.experimental import register_tensor_transport  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("this Ray has no custom tensor transports (needs >= 2.60)", allow_module_level=True)

import ferry
import ferry.ray
from ray import cloudpickle
from ray._common.test_utils import SignalActor, wait_for_condition

try:
    import torch
except ImportError:
    torch = None

# The actor classes below are defined in a test file: Ray would pickle them
# by reference, and the workers cannot import this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
# Before the classes: Ray checks the transport's name when it reads them.
ferry.ray.register()

DEVICES = ["cpu"]
if torch is not None and torch.cuda.is_available():
    DEVICES.append("cuda")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=8, num_gpus=1 if "cuda" in DEVICES else 0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(params=["shm", "tcp"])
def path(request):
    if request.param == "shm" and ferry.shm_unavailable():
        pytest.skip(f"no same-host path here: {ferry.shm_unavailable()}")
    return request.param


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# -- tensors of either kind ----------------------------------------------------


def arange(n, dtype, device="cpu"):
    """Distinct values of ``dtype`` (a numpy dtype name)."""
    a = (numpy.arange(n) % 251).astype(dtype)
    if torch is None:
        return a
    return torch.from_numpy(a).to(device)


def as_numpy(t):
    if torch is not None and isinstance(t, torch.Tensor):
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.cpu().numpy()
    return t


def same(a, b):
    a, b = as_numpy(a), as_numpy(b)
    return a.shape == b.shape and a.dtype == b.dtype and numpy.array_equal(a, b)


def checksum(t):
    a = as_numpy(t)
    return int(numpy.frombuffer(a.tobytes(), numpy.uint8).astype(numpy.uint64).sum())


# -- actors ---------------------------------------------------------------------


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Actor:
    def __init__(self):
        # Ray hands a custom transport to an actor when the driver first
        # calls one of its transport methods; an actor that puts or gets
        # FERRY objects itself registers it first (a no-op if done).
        ferry.ray.register()

    @ray.method(tensor_transport="FERRY")
    def echo(self, value):
        return value

    @ray.method(tensor_transport="FERRY")
    def make(self, n, dtype, device):
        return arange(n, dtype, device)

    @ray.method(tensor_transport="FERRY")
    def big(self, nbytes, device):
        t = arange(nbytes, "uint8", device)
        return t, checksum(t)

    def get(self, value):
        return value

    def checksum(self, value):
        return checksum(value[0]), value[1]

    def put(self, tensors):
        return [ray.put(t, _tensor_transport="FERRY") for t in tensors]

    def get_refs(self, refs):
        return [ray.get(r) for r in refs]

    def devices(self, value):
        return [str(getattr(t, "device", "cpu")) for t in value.values()]

    @ray.method(concurrency_group="_ray_system")
    def block_system_thread(self, signal):
        ray.get(signal.wait.remote())

    def pid(self):
        return os.getpid()

    def stats(self):
        s = ferry.ray.stats()
        m = s.pop("metrics")
        s["reads_ok"] = sum(v for k, v in m.items() if k.startswith("ferry_ops_total{op=\"read\"") and 'result="ok"' in k)
        s["registrations"] = m.get("ferry_registrations", 0)
        return s


def actors(path, n=2, **settings):
    """``n`` actors whose ferry endpoints use ``path`` (shm or tcp), with
    other ``FERRY_*`` settings if given."""
    env = {"env_vars": {"FERRY_TRANSPORT": path, "FERRY_LISTEN_ADDR": "127.0.0.1", **settings}}
    # Ray hides the GPUs from an actor that asks for none.
    gpus = 0.05 if "cuda" in DEVICES else 0
    return [Actor.options(runtime_env=env, num_gpus=gpus).remote() for _ in range(n)]


def reads(actor):
    return ray.get(actor.stats.remote())["reads_ok"]


# -- tests ----------------------------------------------------------------------

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4, 5), (4097,)]


def test_many_dtypes_and_shapes_in_one_object(path, device):
    src, dst = actors(path)
    value = {}
    for d in DTYPES:
        for s in SHAPES:
            n = int(numpy.prod(s)) if s else 1
            t = arange(n, d, device)
            value[f"{d}{s}"] = t.reshape(s)
    if torch is not None:
        value["bf16"] = torch.arange(33, dtype=torch.bfloat16, device=device)
        value["complex64"] = torch.arange(9, dtype=torch.float32).to(torch.complex64).to(device)
    else:
        value["complex64"] = numpy.arange(9).astype(numpy.complex64)
    before = reads(dst)
    ref = src.echo.remote(value)
    got = ray.get(dst.get.remote(ref))
    assert set(got) == set(value)
    for k in value:
        assert same(got[k], value[k]), k
    # One READ for every tensor of the object (the batched request).
    assert reads(dst) == before + 1
    # Received where the source had them.
    assert {d.split(":")[0] for d in ray.get(dst.devices.remote(ref))} == {device}


def test_an_object_passed_to_two_actors(path, device):
    src, a, b = actors(path, 3)
    ref = src.make.remote(10_000, "int32", device)
    want = arange(10_000, "int32", device)
    for dst in (a, b):
        before = reads(dst)
        assert same(ray.get(dst.get.remote(ref)), want)
        assert reads(dst) == before + 1
    # And the driver.
    assert same(ray.get(ref), want)


def test_put_and_get_across_actors(path, device):
    src, dst = actors(path)
    tensors = [arange(n, "float32", device) for n in (3, 4, 5, 1 << 16)]
    refs = ray.get(src.put.remote(tensors))
    before = reads(dst)
    got = ray.get(dst.get_refs.remote(refs))
    assert all(same(g, t) for g, t in zip(got, tensors))
    assert reads(dst) == before + len(tensors)


def test_driver_put_actor_get(device):
    (dst,) = actors("shm", 1)
    t = arange(12345, "int64", device)
    ref = ray.put(t, _tensor_transport="FERRY")
    before = reads(dst)
    assert same(ray.get(dst.get.remote(ref)), t)
    assert reads(dst) == before + 1


def test_a_large_tensor(path, device):
    src, dst = actors(path)
    nbytes = 256 << 20
    ref = src.big.remote(nbytes + 3, device)  # an odd size
    got, want = ray.get(dst.checksum.remote(ref))
    assert got == want


def test_out_of_scope_refs_end_the_registrations(path):
    src, dst = actors(path)
    refs = [src.make.remote(1000 + i, "uint8", "cpu") for i in range(5)]
    for r in refs:
        ray.get(dst.get.remote(r))
    s = ray.get(src.stats.remote())
    assert s["objects"] == 5 and s["registered_tensors"] == 5 and s["registrations"] >= 5
    del refs, r
    wait_for_condition(lambda: ray.get(src.stats.remote())["objects"] == 0, timeout=20)
    s = ray.get(src.stats.remote())
    assert s["registered_tensors"] == 0 and s["registrations"] == 0, s
    # The receiver holds no registration of its own after a fetch either.
    assert ray.get(dst.stats.remote())["registrations"] == 0


def test_the_source_killed_before_the_fetch_is_an_error(path):
    src, dst = actors(path)
    signal = SignalActor.remote()
    # One transfer first: Ray hands the transport to an actor on its system
    # thread when the driver first sends it a transport object.
    assert same(ray.get(dst.get.remote(src.make.remote(5, "uint8", "cpu"))), arange(5, "uint8"))
    # Hold the receiver's system thread, where Ray runs the fetch.
    dst.block_system_thread.remote(signal)
    ref = src.make.remote(1 << 20, "uint8", "cpu")
    result = dst.get.remote(ref)
    ray.wait([ref])
    ray.kill(src)
    time.sleep(0.5)
    signal.send.remote()
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayError) as err:
        ray.get(result, timeout=60)
    assert time.monotonic() - t0 < 30
    print(f"source killed before the fetch ({path}): {type(err.value).__name__}: {str(err.value)[:300]}")
    assert "The FERRY transfer failed" in str(err.value), err.value
    # The receiver still works with a new source.
    (fresh,) = actors(path, 1)
    assert same(ray.get(dst.get.remote(fresh.make.remote(100, "uint8", "cpu"))), arange(100, "uint8"))


def test_the_source_killed_mid_transfer_is_an_error_not_a_hang(path):
    src, dst = actors(path)
    refs = [src.big.remote(64 << 20, "cpu") for _ in range(4)]
    ray.wait(refs, num_returns=len(refs))
    results = [dst.checksum.remote(r) for r in refs]
    time.sleep(0.05)
    ray.kill(src)
    t0 = time.monotonic()
    outcomes = []
    for r in results:
        try:
            got, want = ray.get(r, timeout=60)
            assert got == want  # landed before the kill: whole and right
            outcomes.append("landed")
        except ray.exceptions.RayError as e:
            outcomes.append(type(e).__name__)
    print(f"source killed mid-transfer ({path}): {outcomes} in {time.monotonic() - t0:.2f} s")
    assert time.monotonic() - t0 < 60


def test_a_frozen_source_is_an_error_within_the_op_timeout(path):
    """A source that stops answering (SIGSTOP: no FIN, no RST) fails the
    fetch by ferry's own deadline, not Ray's, and frees the receiver."""
    src, dst = actors(path, FERRY_OP_TIMEOUT_MS="1500")
    ref = src.make.remote(1 << 20, "uint8", "cpu")
    ray.wait([ref])
    assert same(ray.get(dst.get.remote(src.make.remote(5, "uint8", "cpu"))), arange(5, "uint8"))
    pid = ray.get(src.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayError) as err:
            ray.get(dst.get.remote(ref), timeout=60)
        took = time.monotonic() - t0
        print(f"frozen source ({path}): failed after {took:.2f} s: {str(err.value)[:200]}")
        assert "The FERRY transfer failed" in str(err.value), err.value
        assert took < 20
    finally:
        os.kill(pid, signal.SIGCONT)
    # The receiver still works with another source.
    (fresh,) = actors(path, 1)
    assert same(ray.get(dst.get.remote(fresh.make.remote(100, "uint8", "cpu"))), arange(100, "uint8"))


def test_bad_objects_are_refused_with_the_reason():
    (src,) = actors("shm", 1)
    if torch is not None:
        bad = torch.arange(20).reshape(4, 5).t()
    else:
        bad = numpy.arange(20).reshape(4, 5).T
    with pytest.raises(ray.exceptions.RayError, match="not contiguous"):
        ray.get(src.echo.remote([bad]))


def test_abort_ends_a_fetch_and_releases_its_buffers():
    """The transport's own abort (Ray calls it on errors): a fetch asked to
    stop raises, and its registrations end."""
    mgr = ferry.ray.FerryTensorTransport()
    t = arange(1 << 20, "uint8")
    meta = mgr.extract_tensor_transport_metadata("obj", [t])
    comm = mgr.get_communicator_metadata(None, None)
    other = ferry.ray.FerryTensorTransport()
    other.abort_transport("obj", comm)
    with pytest.raises(RuntimeError, match="aborted"):
        other.recv_multiple_tensors("obj", meta, comm)
    # Not aborted: the same fetch lands.
    (got,) = other.recv_multiple_tensors("obj", meta, comm)
    assert same(got, t)
    assert other._stats()["metrics"].get("ferry_registrations", 0) == 0
    mgr.garbage_collect("obj", meta, [t])
    assert mgr._stats()["metrics"]["ferry_registrations"] == 0
    other._endpoint().close()
    mgr._endpoint().close()


def test_a_fetch_polled_with_timeout_zero_stays_whole():
    """Ray's ``wait_fetch_complete(req, timeout=0)`` polls: a fetch not yet
    done raises TimeoutError and lands on a later wait, byte-exact."""
    src, dst = ferry.ray.FerryTensorTransport(), ferry.ray.FerryTensorTransport()
    t = arange(64 << 20, "uint8")
    meta = src.extract_tensor_transport_metadata("big", [t])
    comm = src.get_communicator_metadata(None, None)
    req = dst.fetch_multiple_tensors("big", meta, comm)
    polls = 0
    while True:
        try:
            (got,) = dst.wait_fetch_complete(req, timeout=0)
            break
        except TimeoutError:
            polls += 1
    print(f"64 MiB fetch: {polls} polls before it ended")
    assert same(got, t)
    src.garbage_collect("big", meta, [t])
    assert dst._stats()["metrics"].get("ferry_registrations", 0) == 0
    dst._endpoint().close()
    src._endpoint().close()


def _vm_flags(start, end):
    """The VmFlags of every mapping of this process overlapping [start, end)."""
    flags, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = lo < end and hi > start
            elif cur and line.startswith("VmFlags:"):
                flags.append(line.split()[1:])
    return flags


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="this kernel has no transparent huge pages"
)
def test_fresh_host_buffers_of_ours_are_advised_huge_pages():
    """A fetch's fresh host buffer (torch's allocator gives 4 KiB pages,
    which the source faults in one by one) is advised huge pages over its
    2 MiB-aligned inside, and only there."""
    import ctypes
    import mmap

    # Private and anonymous, as the allocator's large blocks are.
    m = mmap.mmap(-1, 9 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(m)
    try:
        addr = ctypes.addressof(view)
        huge = 2 << 20
        start = -(-(addr + 4096) // huge) * huge
        end = (addr + (9 << 20)) // huge * huge
        assert end - start >= 4 << 20
        before = _vm_flags(start, end)
        assert before and all("hg" not in f for f in before), before
        ferry.ray._advise_huge_pages(addr + 4096, (9 << 20) - 4096)
        inside = _vm_flags(start, end)
        assert inside and all("hg" in f for f in inside), inside
        # The partial huge pages at the ends keep their 4 KiB pages.
        assert all("hg" not in f for f in _vm_flags(addr, start)), _vm_flags(addr, start)
        # Small buffers are left as they are.
        small = _vm_flags(addr, addr + 4096)
        ferry.ray._advise_huge_pages(addr, 4096)
        assert _vm_flags(addr, addr + 4096) == small
    finally:
        del view
        try:
            m.close()
        except BufferError:  # a failed assertion's traceback still holds it
            pass
