"""Run with vLLM's interpreter: parse each argument list of stdin (a JSON list of lists) with vLLM's own
`vllm serve` parser and its checks of the parsed arguments, and print, as JSON, for each one either the parsed
values the tests look at or the error vLLM gives."""

import argparse
import json
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

KEYS = ("model", "served_model_name", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
        "data_parallel_size_local", "data_parallel_start_rank", "data_parallel_rank", "data_parallel_address",
        "data_parallel_rpc_port", "data_parallel_hybrid_lb", "headless", "nnodes", "node_rank", "master_addr",
        "master_port", "enable_expert_parallel", "enable_eplb", "decode_context_parallel_size",
        "prefill_context_parallel_size", "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization",
        "dtype", "shutdown_timeout", "enforce_eager")


def parse(argv: list[str]) -> dict:
    parser = make_arg_parser(FlexibleArgumentParser())
    try:
        ns = parser.parse_args(argv)
        validate_parsed_serve_args(ns)
    except (SystemExit, argparse.ArgumentError, ValueError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    out = {k: getattr(ns, k, None) for k in KEYS}
    eplb = getattr(ns, "eplb_config", None)
    out["eplb_config"] = {k: getattr(eplb, k) for k in ("window_size", "step_interval", "num_redundant_experts")} \
        if eplb is not None and not isinstance(eplb, dict) else eplb
    return out


if __name__ == "__main__":
    print(json.dumps([parse(argv) for argv in json.load(sys.stdin)], default=str))
