import inspect


def supports_kw(callable, kw_name, *, requires_kw_only=False, allow_var_kwargs=True) -> bool:
    """Whether `callable` takes a keyword argument `kw_name` (vllm.utils.func_utils.supports_kw)."""
    params = inspect.signature(callable).parameters
    if not params:
        return False
    p = params.get(kw_name)
    if p is not None:
        if requires_kw_only:
            return p.kind == inspect.Parameter.KEYWORD_ONLY
        return p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    last = next(reversed(params.values()))
    return allow_var_kwargs and last.kind == inspect.Parameter.VAR_KEYWORD
