"""`pagedkv serve | generate`: the command line; engine flags mirror EngineConfig. (Benchmarks run
from a source checkout: `python benches/<name>.py`.)"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import typing
from typing import Union

from pagedkv.config import EngineConfig

DEMO_CONVERSATIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about memory pages.",
    "Explain in two sentences why a KV cache speeds up text generation.",
    "Give three tips for writing readable Python code.",
]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per EngineConfig field, with its type, default and doc in --help."""
    docs = _field_docs()
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine options")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        hint = hints[field.name]
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        help_text = f"{docs.get(field.name, '')} (default: {field.default})".replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=field.default, help=help_text)


def _field_docs() -> dict[str, str]:
    """The docstring under each EngineConfig field (so --help and the code never disagree)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(EngineConfig))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            value = getattr(following, "value", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs[node.target.id] = value.value.strip()
    return docs


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(EngineConfig)})


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.llm import LLM
    from pagedkv.params.sampling import SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config(args)))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, n=args.n, seed=args.seed_sampling,
        structured_outputs=_structured_outputs(args),
    )
    started = time.perf_counter()
    if args.demo or not args.prompts:
        conversations = [[{"role": "user", "content": text}] for text in DEMO_CONVERSATIONS]
        outputs = llm.chat(conversations, params)
        shown = DEMO_CONVERSATIONS
    else:
        outputs = llm.generate(args.prompts, params)
        shown = args.prompts
    elapsed = time.perf_counter() - started
    for prompt, output in zip(shown, outputs):
        print(f"\n>>> {prompt}")
        for completion in output.outputs:
            prefix = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{prefix}{completion.text.strip()}")
    _print_summary(llm.engine, outputs, elapsed)
    return 0


def _structured_outputs(args: argparse.Namespace):
    from pagedkv.params.structured_output import StructuredOutputsParams

    if args.json_schema is None and args.regex is None:
        return None
    schema = args.json_schema
    if schema is not None and os.path.isfile(schema):
        with open(schema, encoding="utf-8") as file:
            schema = file.read()
    return StructuredOutputsParams(json=schema, regex=args.regex)


def _print_summary(engine, outputs, elapsed: float) -> None:
    stats = engine.stats()
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    ttfts = [out.metrics.time_to_first_token for out in outputs if out.metrics.time_to_first_token is not None]
    info = engine.model_info
    rows = [
        ("model", f"{info.name} ({info.dtype}, {info.attention_backend} attention)"),
        ("requests", len(outputs)),
        ("generated tokens", generated),
        ("wall time", f"{elapsed:.1f} s"),
        ("throughput", f"{generated / elapsed:.1f} tokens/s"),
        ("mean time to first token", f"{sum(ttfts) / max(len(ttfts), 1):.2f} s"),
        ("scheduler steps", stats["num_steps"]),
        ("KV blocks (device / CPU)", f"{stats['num_device_blocks']} / {stats['num_cpu_blocks']}"),
        ("prefix-cache hit rate", f"{stats['prefix_cache_hit_rate']:.0%}"),
        ("preemptions (swap / recompute)", f"{stats['num_preemptions_swap']} / {stats['num_preemptions_recompute']}"),
        ("blocks free after the run", f"{stats['num_free_device_blocks']} / {stats['num_device_blocks']}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n" + "-" * (width + 24))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def parse_lora_module(text: str) -> tuple[str, Union[str, dict]]:
    """One --lora-modules value, in either of vLLM's forms: NAME=PATH, or JSON
    {"name": ..., "path": ..., "base_model_name": ...} (the last optional: the adapter's model card
    names it as its parent). (name, path) or (name, {"path", "base_model_name"})."""
    if text.lstrip().startswith("{"):
        try:
            module = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({error})") from None
        if not isinstance(module, dict) or not all(isinstance(module.get(key), str) and module[key]
                                                   for key in ("name", "path")):
            raise ValueError(f"--lora-modules JSON needs string fields name and path, got {text!r}")
        base = module.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: base_model_name must be a string, got {base!r}")
        return module["name"], {"path": module["path"], "base_model_name": base}
    name, separator, path = text.partition("=")
    if not separator or not name or not path:
        raise ValueError(f"--lora-modules takes NAME=PATH pairs or JSON objects, got {text!r}")
    return name, path


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES, serve
    from pagedkv.entrypoints.server.header_timeout import DEFAULT_REQUEST_HEADER_TIMEOUT_SECONDS

    chat_template = args.chat_template
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as file:
            chat_template = file.read()
    try:
        lora_modules = dict(parse_lora_module(module) for module in args.lora_modules)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return serve(engine_config(args), host=args.host, port=args.port, served_model_name=args.served_model_name,
                 chat_template=chat_template, api_key=args.api_key, lora_modules=lora_modules,
                 allow_runtime_lora_updating=args.allow_runtime_lora_updating, reasoning_parser=args.reasoning_parser,
                 tool_call_parser=args.tool_call_parser, max_request_body_bytes=(DEFAULT_MAX_REQUEST_BODY_BYTES if args.max_request_body_bytes is None
                                         else args.max_request_body_bytes),
                 shutdown_grace_seconds=args.shutdown_grace_seconds,
                 request_header_timeout_seconds=(DEFAULT_REQUEST_HEADER_TIMEOUT_SECONDS if args.request_header_timeout is None
                                                 else args.request_header_timeout),
                 enable_force_include_usage=args.enable_force_include_usage,
                 enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                 enable_server_load_tracking=args.enable_server_load_tracking, root_path=args.root_path,
                 uds=args.uds, enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                 enable_per_request_metrics=args.enable_per_request_metrics,
                 return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                 enable_request_id_headers=args.enable_request_id_headers,
                 enable_sagemaker_sessions=args.enable_sagemaker_sessions,
                 trust_request_chat_template=args.trust_request_chat_template,
                 structured_outputs_in_reasoning=args.structured_outputs_config.get("enable_in_reasoning", False)
                 or args.structured_outputs_in_reasoning)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="PagedAttention LLM serving engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for prompts (or the built-in demo)")
    generate.add_argument("prompts", nargs="*", help="prompts; none = the demo conversations")
    generate.add_argument("--demo", action="store_true", help="chat with the built-in demo prompts")
    generate.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    generate.add_argument("--n", type=int, default=1, help="samples per prompt (default: 1)")
    generate.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    generate.add_argument("--json-schema", default=None, help="constrain outputs to this JSON schema (JSON text or a file)")
    generate.add_argument("--regex", default=None, help="constrain outputs to match this regular expression")
    add_engine_arguments(generate)
    generate.set_defaults(func=cmd_generate)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument("--uds", default=None, metavar="PATH", help="serve on this Unix socket instead of host and port")
    serve.add_argument("--root-path", default="", metavar="PREFIX",
                       help="the path prefix a proxy in front strips (links and /openapi.json name it)")
    serve.add_argument("--served-model-name", default=None, help="model name in the API (default: file name)")
    serve.add_argument("--chat-template", default=None,
                       help="Jinja chat template (a file or the template itself; default: the tokenizer's)")
    serve.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served as models of these names, as NAME=PATH or "
                            "JSON {\"name\", \"path\", \"base_model_name\"}; turns --enable-lora on")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details.cached_tokens: prompt tokens the prefix cache "
                            "served (vLLM's flag; off by default, as there)")
    serve.add_argument("--enable-per-request-metrics", action="store_true",
                       help="a one-choice reply carries `metrics`: queue time, time to first token, decode time, "
                            "mean inter-token latency, tokens per second (vLLM's flag; streamed: on the usage chunk)")
    serve.add_argument("--enable-sagemaker-sessions", action="store_true",
                       default=os.environ.get("SAGEMAKER_ENABLE_STATEFUL_SESSIONS", "").lower() in ("1", "true"),
                       help="/invocations opens and closes SageMaker's stateful sessions "
                            "(default: $SAGEMAKER_ENABLE_STATEFUL_SESSIONS)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="a chat request may bring its own chat_template (Jinja the server then runs)")
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="every answer carries X-Request-Id: the request's own, else a fresh one")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name every request's tokens \"token_id:<id>\" (vLLM's flag; a request's "
                            "return_tokens_as_token_ids does it for that request)")
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="GET /tokenizer_info: the tokenizer's configuration and chat template")
    serve.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load counts the requests in flight on the routes that use the engine")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every streamed answer ends with a usage chunk, whether the request asked or not")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                       help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load adapters from this "
                            "machine's disk while serving (default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    serve.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3", "openai_gptoss"], default=None,
                       help="move chat replies' <think> blocks (GPT-OSS: analysis messages) to reasoning_content (default: none)")
    serve.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral", "openai"], default="hermes",
                       help="how tool calls are found in replies with tool_choice auto (default: hermes)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM compatibility: tool_choice auto is always on")
    serve.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY", os.environ.get("VLLM_API_KEY")),
                       help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                            "$PAGEDKV_API_KEY, else vLLM's $VLLM_API_KEY, else none; an empty key is an error)")
    serve.add_argument("--max-request-body-bytes", type=int, default=None,
                       help="larger request bodies get HTTP 413 (default: 33554432, 32 MiB)")
    serve.add_argument("--request-header-timeout", type=float, default=None,
                       help="a connection whose request line and headers have not all arrived this many seconds "
                            "after it opened (or after the next request's first bytes) gets HTTP 408 and is closed "
                            "(default: 15)")
    serve.add_argument("--shutdown-grace-seconds", type=float, default=10.0,
                       help="at SIGTERM, in-flight requests may finish for this long; the rest are aborted "
                            "(streams end with finish_reason abort and [DONE]) (default: %(default)s)")
    add_engine_arguments(serve)
    compat = serve.add_argument_group("vLLM flags accepted so that vLLM command lines start (no effect here)")
    serve.add_argument("--structured-outputs-config", dest="structured_outputs_config", type=structured_outputs_config,
                       default={}, metavar="JSON",
                       help='vLLM\'s JSON form: {"backend": "xgrammar" or "auto" (pagedkv\'s structured outputs run on '
                            'xgrammar; another backend is an error), "enable_in_reasoning": true or false}')
    serve.add_argument("--structured-outputs-config.enable_in_reasoning", dest="structured_outputs_in_reasoning",
                       action="store_true", help="with --reasoning-parser, grammars constrain the reasoning too "
                                                 "(by default they start once the reply's reasoning has ended)")
    compat.add_argument("--structured-outputs-config.backend", dest="structured_outputs_backend",
                        type=structured_outputs_backend, default="xgrammar", metavar="BACKEND",
                        help="xgrammar or auto: pagedkv's structured outputs run on xgrammar; another backend is an error")
    compat.add_argument("--trust-remote-code", action="store_true",
                        help="pagedkv runs no checkpoint's own code: its model classes are its own")
    compat.add_argument("--show-hidden-metrics-for-version", default=None, metavar="VERSION",
                        help="no metric is hidden here")
    compat.add_argument("--disable-log-stats", action="store_true", help="pagedkv logs no periodic stats")
    compat.add_argument("--disable-log-requests", action="store_true", help="pagedkv logs no request bodies")
    serve.set_defaults(func=cmd_serve)

    return parser


def structured_outputs_config(value: str) -> dict:
    """vLLM's --structured-outputs-config: a JSON object whose "backend" is xgrammar or auto and
    whose "enable_in_reasoning" is a boolean (its other keys change nothing here), or a backend."""
    if not value.lstrip().startswith("{"):
        return {"backend": structured_outputs_backend(value)}
    try:
        config = json.loads(value)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {value!r}")
    structured_outputs_backend(config.get("backend", "auto"))
    if not isinstance(config.get("enable_in_reasoning", False), bool):
        raise argparse.ArgumentTypeError(f"enable_in_reasoning must be true or false, got {config['enable_in_reasoning']!r}")
    return config


def structured_outputs_backend(value: str) -> str:
    """vLLM's --structured-outputs-config.backend: xgrammar or auto."""
    backend = value
    if backend not in ("auto", "xgrammar"):
        raise argparse.ArgumentTypeError(f"pagedkv's structured outputs run on xgrammar; backend {backend!r} is not "
                                         "available")
    return "xgrammar"


def main(argv=None) -> int:
    from pagedkv.errors import InvalidConfigError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except InvalidConfigError as error:  # (a configuration mistake: one line, not a traceback)
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
