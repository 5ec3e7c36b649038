"""A stand-in for the parts of vLLM that sparsekv.vllm uses, for tests on machines without vLLM.

Laid out like vLLM's own modules, with vLLM's class names, method names, argument kinds and
return types, written from vLLM's source at the commits named in sparsekv/vllm.py (connector base
at 003df2961dd8830c317a61f9745ccd557da9fa06, factory at a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630).
Only what a KV connector sees is here; nothing of vLLM's model execution."""

__version__ = "0.0.0+sparsekv.standin"
STANDIN = True
