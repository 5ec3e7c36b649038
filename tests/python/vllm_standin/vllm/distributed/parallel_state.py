"""vllm.distributed.parallel_state: the tensor-parallel group a worker belongs to. vLLM sets
_TP when it initializes model parallelism; tests set it as that would."""


class GroupCoordinator:
    def __init__(self, rank_in_group=0, world_size=1):
        self.rank_in_group = rank_in_group
        self.world_size = world_size


_TP: GroupCoordinator | None = None


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor model parallel group is not initialized"
    return _TP


def get_tensor_model_parallel_world_size():
    return get_tp_group().world_size


def get_tensor_model_parallel_rank():
    return get_tp_group().rank_in_group
