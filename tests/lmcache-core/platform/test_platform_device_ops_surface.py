"""DeviceOps: the 33 declared ops, __getattr__, LATER errors, bind_native, operand mode."""

from __future__ import annotations

import inspect
import logging
import types

import pytest
import torch

from lmcache.v1.platform import ops_types, torch_ops
from lmcache.v1.platform.base.device_ops import (
    DEVICE_OP_NAMES,
    DeviceOps,
    resolve_kv_transfer_operands,
)

LATER_CALLS = {
    "multi_layer_kv_transfer_unilateral": (None,) * 7,
    "single_layer_kv_transfer": (None,) * 5,
    "single_layer_kv_transfer_sgl": (None,) * 5,
    "load_and_reshape_flash": (None,) * 5,
    "reshape_and_cache_back_flash": (None,) * 5,
    "encode_fast_new": (None,) * 4,
    "decode_fast_new": (None,) * 4,
    "decode_fast_prefsum": (None,) * 4,
    "rotary_embedding_k_fused": (None,) * 6,
    "rotary_embedding_k_fused_strided": (None,) * 7,
    "get_gpu_pci_bus_id": (0,),
}


def test_33_ops_are_declared_on_the_class_body_with_the_baseline_signature():
    assert len(DEVICE_OP_NAMES) == 33 and len(set(DEVICE_OP_NAMES)) == 33
    for name in DEVICE_OP_NAMES:
        assert name in DeviceOps.__dict__, name
        method = DeviceOps.__dict__[name]
        assert inspect.isfunction(method)
        if name == "tensor_from_ptr":
            baseline = torch_ops.pointer_view
        else:
            baseline = getattr(torch_ops, name)
        base_params = list(inspect.signature(baseline).parameters)
        assert list(inspect.signature(method).parameters)[1:] == base_params, name


def test_every_registered_specs_ops_class_has_all_ops():
    from lmcache.v1.platform import default_device_registry

    for name, spec in default_device_registry().backends().items():
        cls = spec.ops_cls
        for op in DEVICE_OP_NAMES:
            assert callable(getattr(cls, op, None)), (name, op)


@pytest.mark.parametrize("op", sorted(LATER_CALLS))
def test_later_ops_raise_the_documented_error(op):
    ops = DeviceOps()
    with pytest.raises(NotImplementedError) as ei:
        getattr(ops, op)(*LATER_CALLS[op])
    assert str(ei.value) == (
        f"torch baseline for {op} is not implemented yet; a native backend may provide it"
    )


def test_getattr_names_the_missing_operation_and_hasattr_probes_work():
    ops = DeviceOps()
    with pytest.raises(AttributeError) as ei:
        ops.execute_object_group_transfer  # noqa: B018
    assert str(ei.value) == "DeviceOps has no device operation 'execute_object_group_transfer'"
    for name in (
        "execute_direct_copy_transfer",
        "batch_memcpy_supported",
        "direct_copy_format_supported",
        "execute_cb_retrieve_plan_flat",
        "pop_completed_phase_timings",
        "DirectCopyObject",
        "DirectCopyGroupSpec",
        "CBGroupSpec",
    ):
        assert not hasattr(ops, name)


def test_cpu_device_ops_has_no_enum_or_predicate_attributes():
    import lmcache

    ops = lmcache.device_ops
    for name in ("TransferDirection", "EngineKVFormat", "GPUKVFormat", "is_mla", "is_kv_list"):
        assert not hasattr(ops, name), name
    assert ops.PageBufferShapeDesc is ops_types.PageBufferShapeDesc
    assert ops.KernelGroupSpec is ops_types.KernelGroupSpec
    desc = ops.PageBufferShapeDesc()
    desc.nl, desc.dtype = 3, torch.bfloat16
    ops.set_shape_desc_dtype(desc, torch.float16)
    assert desc.dtype is torch.float16


@pytest.mark.parametrize("stub", [ops_types.StagingCopy, ops_types.LaunchVar, ops_types.BatchStep])
def test_native_only_stubs_raise(stub):
    with pytest.raises(NotImplementedError) as ei:
        stub()
    assert stub.__name__ in str(ei.value) and "native" in str(ei.value)


def test_tensor_from_ptr_base_raises_and_cpu_returns_a_view():
    with pytest.raises(ValueError) as ei:
        DeviceOps().tensor_from_ptr(1234, (2,), torch.float32)
    assert "does not support tensor construction from raw pointers" in str(ei.value)
    src = torch.arange(12, dtype=torch.float32)
    view = torch_ops.pointer_view(src.data_ptr(), (3, 4), torch.float32)
    view[1, 1] = -1.0
    assert src[5].item() == -1.0
    with pytest.raises(ValueError, match="null"):
        torch_ops.pointer_view(0, (1,), torch.float32)


def _fake_native_module():
    mod = types.ModuleType("fake_native_ops")

    def multi_layer_block_kv_transfer(*args):
        return "native-transfer"

    def brand_new_op():
        return "new"

    class EngineKVFormat:  # a native enum type
        pass

    class StagingCopy:
        pass

    class PageBufferShapeDesc:
        def __init__(self):
            self.kv_size = self.nl = self.nb = self.bs = self.nh = self.hs = 0
            self.element_size = self.block_stride_elems = 0
            self.dtype = None

    mod.multi_layer_block_kv_transfer = multi_layer_block_kv_transfer
    mod.brand_new_op = brand_new_op
    mod.EngineKVFormat = EngineKVFormat
    mod.StagingCopy = StagingCopy
    mod.PageBufferShapeDesc = PageBufferShapeDesc
    mod._private = lambda: None
    mod.nothing = None
    mod.CONSTANT = 7
    mod.submodule = types.ModuleType("fake_native_ops.sub")
    return mod


def test_bind_native_binds_on_the_instance_only(caplog):
    mod = _fake_native_module()
    ops, other = DeviceOps(), DeviceOps()
    with caplog.at_level(logging.DEBUG, logger="lmcache"):
        ops.bind_native(mod)
    assert ops.multi_layer_block_kv_transfer() == "native-transfer"
    assert ops.brand_new_op() == "new"
    assert ops.GPUKVFormat is mod.EngineKVFormat and ops.EngineKVFormat is mod.EngineKVFormat
    assert ops.StagingCopy is mod.StagingCopy
    desc = ops.PageBufferShapeDesc()
    desc.nl, desc.dtype = 4, torch.float16  # same mutable fields
    assert not hasattr(ops, "_private") and not hasattr(ops, "nothing")
    assert not hasattr(ops, "CONSTANT") and not hasattr(ops, "submodule")
    # other instances keep the baseline
    assert other.StagingCopy is ops_types.StagingCopy
    assert not hasattr(other, "brand_new_op") and not hasattr(other, "GPUKVFormat")
    assert "bind_native: DeviceOps <- fake_native_ops (2 ops, 3 types)" in caplog.text


def test_operand_mode_resolution():
    base = DeviceOps()
    assert resolve_kv_transfer_operands(base) == ("tensor", None)

    class Declared(DeviceOps):
        kv_transfer_operands = "pointer"
        max_objects_per_call = 16

    assert resolve_kv_transfer_operands(Declared()) == ("pointer", 16)

    class Annotated(DeviceOps):
        def multi_layer_block_kv_transfer(
            self, paged_buffer_ptrs_tensor, lmcache_objects_ptrs: list[torch.Tensor], *rest
        ):
            return None

    assert resolve_kv_transfer_operands(Annotated()) == ("tensor", None)

    class Unannotated(DeviceOps):
        def multi_layer_block_kv_transfer(self, paged_buffer_ptrs_tensor, lmcache_objects_ptrs, *r):
            return None

    assert resolve_kv_transfer_operands(Unannotated()) == ("pointer", 4)

    # attribute wins over the annotation
    class AttrWins(Annotated):
        kv_transfer_operands = "pointer"

    assert resolve_kv_transfer_operands(AttrWins())[0] == "pointer"

    # a natively bound (pybind-like, no signature) op -> pointer; instance attribute wins
    ops = DeviceOps()
    ops.bind_native(types.SimpleNamespace(multi_layer_block_kv_transfer=len))
    assert resolve_kv_transfer_operands(ops) == ("pointer", 4)
    ops.kv_transfer_operands = "tensor"
    assert resolve_kv_transfer_operands(ops) == ("tensor", None)

    from lmcache.v1.platform.devices.cpu import CpuDeviceOps

    assert resolve_kv_transfer_operands(CpuDeviceOps()) == ("tensor", None)


def test_format_predicates_live_in_ops_types():
    F = ops_types.EngineKVFormat
    assert [int(f) for f in F] == list(range(19))
    assert ops_types.TransferDirection.H2D == 0 and ops_types.TransferDirection.D2H == 1
    assert ops_types.TransferPhase.KERNEL == 0 and ops_types.TransferPhase.STAGING == 1
    assert ops_types.is_cross_layer(0) and ops_types.is_cross_layer(F.NB_NL_TWO_NH_BS_HS)
    assert ops_types.is_kv_list(4) and ops_types.is_kv_list(9) and not ops_types.is_kv_list(1)
    assert {f for f in range(19) if ops_types.is_mla(f)} == {3, 5, 14, 17}
    assert {f for f in range(19) if ops_types.is_hnd(f)} == {6, 7, 8, 10, 12, 15}
    assert {f for f in range(19) if ops_types.is_two_major(f)} == {1, 6, 15}
    assert {f for f in range(19) if ops_types.is_kv_second_tuple(f)} == {16, 17}
    assert {f for f in range(19) if ops_types.is_fused_packed(f)} == {10, 11, 12, 13}
    assert {f for f in range(19) if ops_types.is_pbs_fused(f)} == {4, 5}
    assert ops_types.is_single_kv(18) and ops_types.is_layer_list(18)
    assert not hasattr(DeviceOps, "is_mla")
    spec = ops_types.KernelGroupSpec([1], [2], ops_types.PageBufferShapeDesc(), 256, F(1), 0, 8)
    assert spec.lmcache_chunk_size == 256 and spec.block_ids_capacity == 8
