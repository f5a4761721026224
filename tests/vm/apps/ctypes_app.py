#!/usr/bin/python3
"""A Python application that reaches libibverbs through ctypes, which loads it with
dlopen(RTLD_LOCAL) and finds each verb with dlsym on that handle, as language bindings do.
It lists the devices, opens one, queries port 1, allocates a PD, creates a CQ and an RC QP,
frees them
and prints one "result" line that must be the same plain, under the unconfigured shaper
and shaped.

    ctypes_app.py [DEVICE]      (default rxe0)
    ctypes_app.py --plugin PLUGIN [DEVICE]

With --plugin it loads PLUGIN (ping_plugin.c, a library linked against libibverbs, as an
extension module is) through ctypes and runs its WRITE + SEND ping exchange instead.

Exit status: 0 on success, 2 with the failing verb and its errno otherwise.
"""
import ctypes
import os
import sys


IBV_QPT_RC = 2


class QpCap(ctypes.Structure):
    """struct ibv_qp_cap."""
    _fields_ = [(f, ctypes.c_uint32) for f in
                ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data")]


class QpInitAttr(ctypes.Structure):
    """struct ibv_qp_init_attr."""
    _fields_ = [("qp_context", ctypes.c_void_p), ("send_cq", ctypes.c_void_p),
                ("recv_cq", ctypes.c_void_p), ("srq", ctypes.c_void_p), ("cap", QpCap),
                ("qp_type", ctypes.c_int), ("sq_sig_all", ctypes.c_int)]


def fail(what):
    err = ctypes.get_errno()
    print(f"ctypes_app: error: {what}: {os.strerror(err)} (errno {err})", file=sys.stderr)
    sys.exit(2)


def run_plugin(path, name):
    plugin = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    plugin.ping_plugin_run.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    out = ctypes.create_string_buffer(256)
    rc = plugin.ping_plugin_run(name.encode(), out, len(out))
    if rc != 0:
        print(f"ctypes_app: error: the plugin's exchange failed: {os.strerror(rc)} (errno {rc})",
              file=sys.stderr)
        sys.exit(2)
    print(f"ctypes_app: {out.value.decode()}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--plugin":
        run_plugin(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "rxe0")
        return
    name = sys.argv[1] if len(sys.argv) > 1 else "rxe0"
    ibv = ctypes.CDLL("libibverbs.so.1", mode=os.RTLD_NOW | os.RTLD_LOCAL, use_errno=True)
    vp = ctypes.c_void_p
    ibv.ibv_get_device_list.restype = ctypes.POINTER(vp)
    ibv.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    ibv.ibv_free_device_list.argtypes = [ctypes.POINTER(vp)]
    ibv.ibv_get_device_name.restype = ctypes.c_char_p
    ibv.ibv_get_device_name.argtypes = [vp]
    ibv.ibv_open_device.restype = vp
    ibv.ibv_open_device.argtypes = [vp]
    ibv.ibv_close_device.argtypes = [vp]
    ibv.ibv_query_port.argtypes = [vp, ctypes.c_uint8, vp]
    ibv.ibv_alloc_pd.restype = vp
    ibv.ibv_alloc_pd.argtypes = [vp]
    ibv.ibv_dealloc_pd.argtypes = [vp]
    ibv.ibv_create_cq.restype = vp
    ibv.ibv_create_cq.argtypes = [vp, ctypes.c_int, vp, vp, ctypes.c_int]
    ibv.ibv_destroy_cq.argtypes = [vp]

    count = ctypes.c_int(0)
    devices = ibv.ibv_get_device_list(ctypes.byref(count))
    if not devices:
        fail("ibv_get_device_list")
    names = [ibv.ibv_get_device_name(devices[i]).decode() for i in range(count.value)]
    print(f"ctypes_app: {count.value} device(s): {' '.join(names)}")
    if name not in names:
        print(f"ctypes_app: error: no device {name}", file=sys.stderr)
        sys.exit(2)
    ctypes.set_errno(0)
    ctx = ibv.ibv_open_device(devices[names.index(name)])
    ibv.ibv_free_device_list(devices)
    if not ctx:
        fail("ibv_open_device")
    # struct ibv_port_attr begins with state, max_mtu and active_mtu (enums, 4 bytes
    # each); the buffer is larger than the whole structure.
    port = (ctypes.c_uint32 * 64)()
    rc = ibv.ibv_query_port(ctx, 1, port)
    if rc != 0:
        ctypes.set_errno(rc)
        fail("ibv_query_port")
    pd = ibv.ibv_alloc_pd(ctx)
    if not pd:
        fail("ibv_alloc_pd")
    cq = ibv.ibv_create_cq(ctx, 64, None, None, 0)
    if not cq:
        fail("ibv_create_cq")
    # An RC QP on that CQ, created and destroyed through the handle: under the shaper its
    # JUSTITIA_STATS count it ("qps"), which they do only if ibv_create_qp reached the shaper.
    ibv.ibv_create_qp.restype = vp
    ibv.ibv_create_qp.argtypes = [vp, ctypes.POINTER(QpInitAttr)]
    ibv.ibv_destroy_qp.argtypes = [vp]
    attr = QpInitAttr(send_cq=cq, recv_cq=cq, cap=QpCap(16, 16, 1, 1, 0), qp_type=IBV_QPT_RC)
    qp = ibv.ibv_create_qp(pd, ctypes.byref(attr))
    if not qp:
        fail("ibv_create_qp")
    print(f"ctypes_app: result device={name} port_state={port[0]} max_mtu={port[1]} "
          f"active_mtu={port[2]} pd=ok cq=ok qp=ok")
    for verb, obj in (("ibv_destroy_qp", qp), ("ibv_destroy_cq", cq), ("ibv_dealloc_pd", pd),
                      ("ibv_close_device", ctx)):
        rc = getattr(ibv, verb)(obj)
        if rc != 0:
            ctypes.set_errno(rc)
            fail(verb)


if __name__ == "__main__":
    main()
