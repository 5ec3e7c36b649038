"""vllm/v1/request.py: a request's tokens, its chained block hashes (kept up to date by the block
hasher as tokens are appended) and its computed-token count."""

from collections.abc import Callable


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params=None, pooling_params=None,
                 eos_token_id: int | None = None, arrival_time: float | None = None,
                 block_hasher: Callable[["Request"], list] | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.kv_transfer_params = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.get_hash_new_full_blocks = None
        if block_hasher is not None:
            self.get_hash_new_full_blocks = lambda: block_hasher(self)
            self.block_hashes = self.get_hash_new_full_blocks()

    @property
    def all_token_ids(self):
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self.get_hash_new_full_blocks is not None:
            self.block_hashes.extend(self.get_hash_new_full_blocks())
