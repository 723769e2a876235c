"""end_distributed: the process group and its subgroups are destroyed, and it does nothing without one."""

from __future__ import annotations

from lightning_gpuopt.strategies import end_distributed


def test_end_distributed_destroys_the_group_and_is_a_no_op_without_one():
    import torch.distributed as dist

    end_distributed()  # nothing started: nothing to do
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        sub = dist.new_group([0])
        assert dist.is_initialized() and dist.get_world_size(sub) == 1
        end_distributed()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
