"""The ``vllm-eagle3`` command: one parser, one exit-status rule."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ._base import (CANNOT, OK, PROBLEM, ToolError, children_never_shadowed,
                    drop_source_trees_from_path, dump_json, parse_ids, print_out,
                    quiet_libraries, refuse_swapped, resolve_checkpoint)

PROG = "vllm-eagle3"
EXIT = """exit status:
  0  {ok}
  1  {problem}
  2  could not {verb}: a missing or malformed file, a bad argument, or no vLLM
     that can do it (one line on stderr names the problem and the fix)"""

MAIN = """\
The drafter tools of the EAGLE-3 series for vLLM 0.16.0: what an EAGLE-3
drafter is fed, whether it fits its target, and which layer numbering it was
trained in. They ask the installed vLLM (the series' wheel): run them with
the Python of the environment that serves. show, check and convert read
configs and weight headers only (no GPU, no weights); calibrate runs the
target model (a GPU, or the CPU build).

  vllm-eagle3 doctor                                  is the series installed?
  vllm-eagle3 show DRAFTER [--target TARGET]          which layers vLLM feeds it
  vllm-eagle3 check DRAFTER --target TARGET           does it fit its target?
  vllm-eagle3 convert DRAFTER --from output-of-layer  ids into vLLM's numbering
  vllm-eagle3 calibrate DRAFTER --target TARGET       which numbering, measured

DRAFTER and TARGET: a checkpoint directory, or a Hugging Face repo id
(org/name) already in the local cache (`huggingface-cli download org/name`;
these tools never download).

`vllm-eagle3 SUBCOMMAND --help` explains each one's arguments, output and
exit status: 0 fits (or done), 1 a problem found, 2 could not check."""

DOCTOR = """\
Does the vLLM this Python imports carry the EAGLE-3 series? Asks vLLM itself
(registry, SpeculativeConfig, config classes) about what each patch adds.

output:
  vllm: PATH (version V)     the vLLM that was imported
  PROBLEM  ...; fix: ...     vllm was imported from a source tree, not the
                             installed wheel (PYTHONPATH, or the working
                             directory)
  warn     ...               the working directory holds a vllm/ source tree
                             that a `vllm serve` started here would import
  ok       PATCH: what       one line per patch of the series: present
  MISSING  PATCH: error      ... or missing
  summary: N of M patches present
  then, with --drafter, what `show` prints"""

SHOW = """\
Which target layers vLLM feeds the drafter: its aux ids, where they come from
(top-level eagle_aux_hidden_state_layer_ids, nested eagle_config..., or the
target's default (2, n//2, n-3)), and each id read both ways. In vLLM an aux
id k is the INPUT of target layer k; SGLang, SpecForge, TorchSpec and
speculators 0.3-0.4 count the OUTPUT of layer k, which is vLLM's id k + 1;
speculators from 0.5 writes vLLM's ids.

output:
  drafter: DIR (architectures: [...])
  target: DIR, N layers: ids 0..N are valid         (with --target)
  aux ids: [a, b, c]  (source: ...)
  vLLM captures: input of layer a, ...
    equivalently: output of layer a-1, ...
    id   a: ... = ...                               one line per id
  ids [...] are outside [0, N] / not strictly ascending   (problems)
  numbering: input-of-layer | output-of-layer | undetermined, as recorded: ...
                        what the config records of the toolchain that wrote
                        it (vllm_eagle3_converted, _torchspec_version,
                        speculators_version), or that it records none"""

CHECK = """\
Preflight: does the drafter fit the target? Reads both configs through vLLM
(SpeculativeConfig, as the engine does) and the drafter's safetensors
headers (or its pytorch_model*.bin, mapped onto the meta device), never the
weights; builds vLLM's drafter class on the meta device and runs its own
load_weights over tensors of those shapes. Needs no GPU: the verdicts are
the same with the CUDA wheel on a machine without one.

output (one line per check):
  drafter DIR -> target DIR (model_type, N layers, hidden H, vocab V)
  ok    WHAT                     a check passed
  warn  WHAT[; fix: FIX]         served, but worth a look (ids only nested,
                                 or none at all on a DeepSeek-family target)
  ok|warn numbering: ...         the numbering the config's record implies
                                 (a FAIL when the ids still need + 1)
  FAIL  PROBLEM; fix: FIX        the engine would refuse the pair, or serve it
                                 wrongly
  the pair fits | N problems: the pair does not fit
Without weights, every clash the configs show is a line, and the missing
weights one more."""

CONVERT = """\
Write the drafter's ids in vLLM's numbering into config.json: top level, and
into eagle_config where that holds ids. --from says how the config (or --ids)
counts: output-of-layer adds 1 to each id, input-of-layer keeps them. The
conversion is recorded in the config (vllm_eagle3_converted), and a converted
config is refused, so ids are never shifted twice; so is a --from that the
config's record contradicts (_torchspec_version, speculators_version). In
place it keeps config.json.orig; with --out it writes a copy whose files are
hard links to what they resolve to (a Hugging Face snapshot's blobs), or
copies across filesystems. config.json keeps its permission bits.

output:
  DIR/config.json: eagle_aux_hidden_state_layer_ids = [...]
    from [...] (where) counted as CONVENTION: each id + 1 | unchanged
    vLLM captures the inputs of layers [...] = outputs of layers [...]
    numbering: ... (as show)"""

CALIBRATE = """\
Which layers was the drafter trained on? Measures greedy acceptance (k = 3)
under each reading of its ids: input-of-layer (vLLM ids = the ids),
output-of-layer (ids + 1), and every --candidates list; names the best when
it beats the runner-up by 0.05 in mean acceptance length and by 3 standard
errors. Runs the target model: on a GPU it serves the target with the
drafter once per reading (the engine's spec-decode counters); on the CPU
build it captures the states in one CPU engine run and replays drafting with
vLLM's drafter class (not for GLM-5 or DeepSeek-V3.2 targets: their sparse
attention needs vLLM's MLA path, which the CPU build lacks; calibrate them
on a GPU). A progress bar goes to stderr.

output:
  drafter DIR, target DIR (N layers): aux ids [...] from SOURCE
  P prompts x T greedy tokens, k = 3, how it was measured
  READING [ids]: mean acceptance length L over D drafts; accepted at
      position 1..3: r1 r2 r3            one line per reading
  margin rule: BEST beats RUNNER-UP by G in mean acceptance length, needed M
  verdict: input-of-layer | output-of-layer | ids a,b,c | undetermined
  with --write: what convert prints, or "nothing written" (undetermined)"""


class UsageError(ToolError):
    """A bad command line, as argparse words it."""


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line that says where the arguments are
    explained, and reaches run(), which prints it as JSON under --json."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (`{self.prog} --help` explains "
                         "the arguments)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the lines (the same fields); an "
                        "error is {\"error\": ...} on stdout, exit status 2")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="let vLLM's and transformers' own warnings through to stderr")


def version() -> str:
    """This command's version (the series wheel's), without importing vLLM."""
    import importlib.metadata

    if __package__ == "vllm_eagle3":
        try:
            return importlib.metadata.version("vllm-eagle3")
        except importlib.metadata.PackageNotFoundError:
            pass
    return "from a clone (not installed)"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = Parser(prog=prog, description=MAIN, formatter_class=fmt)
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                    help="print the version (the series wheel's) and exit")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="SUBCOMMAND")

    def add(name: str, text: str, summary: str, **exit_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=text,
                              epilog=EXIT.format(**exit_text), formatter_class=fmt)

    dp = add("doctor", DOCTOR, "is the EAGLE-3 series in the vLLM this Python imports?",
             ok="every patch present, vllm is the installed wheel",
             problem="a patch missing, or vllm imported from a source tree",
             verb="import vLLM")
    dp.add_argument("--drafter", type=Path, metavar="DRAFTER_DIR",
                    help="an EAGLE-3 drafter's checkpoint directory: also print what vLLM "
                         "captures for it (as `show`)")
    dp.add_argument("--target", type=Path, metavar="TARGET_DIR",
                    help="with --drafter: the target's checkpoint directory (its layer count "
                         "gives the default ids and the valid range)")
    _add_json(dp)

    sp = add("show", SHOW, "which target layers vLLM feeds the drafter",
             ok="shown", problem="the ids are outside the target or not ascending "
             "(the engine refuses them)", verb="read the configs")
    sp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR",
                    help="the drafter's checkpoint directory (config.json), or org/name in the "
                         "Hugging Face cache")
    sp.add_argument("--target", type=Path, metavar="TARGET_DIR",
                    help="the target's checkpoint directory: gives n for the default ids and "
                         "the range check")
    _add_json(sp)

    kp = add("check", CHECK, "preflight: does the drafter fit the target? (configs and "
             "weight headers only)", ok="the pair fits (warn lines may remain)",
             problem="a FAIL line: the pair does not fit", verb="check")
    kp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR",
                    help="the drafter's checkpoint directory (config.json, *.safetensors or "
                         "pytorch_model*.bin), or "
                         "org/name in the Hugging Face cache")
    kp.add_argument("--target", type=Path, metavar="TARGET_DIR", required=True,
                    help="the target's checkpoint directory (or org/name in the Hugging Face "
                         "cache); config.json is all it needs")
    kp.add_argument("--trust-remote-code", action="store_true",
                    help="let transformers run the checkpoints' own config code, as "
                         "`vllm serve --trust-remote-code` does")
    _add_json(kp)

    cp = add("convert", CONVERT, "write the ids in vLLM's numbering into config.json",
             ok="written", problem="(not used: a refusal writes nothing and exits 2)",
             verb="convert")
    cp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR",
                    help="the drafter's checkpoint directory (config.json), or org/name in the "
                         "Hugging Face cache")
    cp.add_argument("--from", dest="convention", required=True,
                    choices=("output-of-layer", "input-of-layer"),
                    help="how the config's ids count: output-of-layer (SGLang, SpecForge, "
                         "speculators 0.3-0.4) or input-of-layer (vLLM, speculators from 0.5)")
    cp.add_argument("--ids", type=parse_ids, metavar="K,K,K",
                    help="the ids the drafter was trained on, for a config that has none")
    cp.add_argument("--target", type=Path, metavar="TARGET_DIR",
                    help="refuse ids outside [0, n] for this target")
    cp.add_argument("--out", type=Path, metavar="DIR",
                    help="write a converted copy to this new directory instead of "
                         "converting in place")
    _add_json(cp)

    lp = add("calibrate", CALIBRATE, "measure which layers the drafter was trained on",
             ok="a verdict: one reading wins by the margin",
             problem="verdict undetermined (more or longer prompts narrow the margin)",
             verb="measure")
    lp.add_argument("drafter", type=Path, metavar="DRAFTER_DIR",
                    help="the drafter's checkpoint directory")
    lp.add_argument("--target", type=Path, metavar="TARGET_DIR", required=True,
                    help="the target model's checkpoint directory (weights and tokenizer)")
    lp.add_argument("--candidates", metavar="IDS;IDS",
                    type=lambda t: [parse_ids(c, "--candidates") for c in t.split(";")
                                    if c.strip()],
                    help="more readings to measure, as vLLM ids, e.g. \"1,29,57;2,30,58\" "
                         "(for a drafter whose config names no ids, or ids of another run)")
    lp.add_argument("--prompts", type=Path, metavar="FILE",
                    help="one prompt a line (default: a built-in set of 8)")
    lp.add_argument("--max-tokens", type=positive_int, default=64, metavar="T",
                    help="greedy tokens per prompt (default 64)")
    lp.add_argument("--write", action="store_true",
                    help="write the winning ids into config.json as convert does (in place, "
                         "config.json.orig kept); when undetermined nothing is written (exit 1)")
    lp.add_argument("--via", choices=("auto", "replay", "spec-decode"), default="auto",
                    help="auto (default): replay on the CPU build, spec-decode on a GPU")
    lp.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="TP",
                    help="spec-decode: the target's tensor-parallel size")
    lp.add_argument("--enforce-eager", action="store_true",
                    help="spec-decode: no torch.compile or CUDA graphs (faster start)")
    lp.add_argument("--trust-remote-code", action="store_true",
                    help="let transformers run the checkpoints' own config code")
    _add_json(lp)
    return ap


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Parse, run, print; returns the exit status. ToolError propagates (run()
    prints it)."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    with children_never_shadowed():
        return _dispatch(ap, args)


def _dispatch(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    # Before vLLM is imported: its log lines go to stderr (stdout is the
    # report, or the JSON), and only errors unless asked for more.
    quiet_libraries(args.verbose)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if args.cmd == "doctor" else "ERROR")
    if args.cmd == "doctor" and args.target is not None and args.drafter is None:
        ap.error("doctor: --target needs --drafter (it gives the drafter's default ids)")
    # DIR or org/name (from the local Hugging Face cache), checked before vLLM
    # is imported; then every lookup is of a local path: none goes to the hub.
    for what in ("drafter", "target"):
        if getattr(args, what, None) is not None:
            setattr(args, what, resolve_checkpoint(getattr(args, what), what))
    os.environ["HF_HUB_OFFLINE"] = "1"
    if args.drafter is not None and args.target is not None:
        refuse_swapped(args.drafter, args.target)
    if args.cmd == "doctor":
        from .doctor import run as doctor

        return doctor(args.drafter, args.target, as_json=args.json)
    if args.cmd in ("show", "convert"):
        from .layers import convert_data, show_data, show_lines

        if args.cmd == "convert":
            done = convert_data(args.drafter, args.convention, out=args.out,
                                target=args.target, ids=args.ids)
            print_out(dump_json({k: v for k, v in done.items() if k != "lines"}) if args.json
                  else "\n".join(done["lines"]))
            return OK
        data = show_data(args.drafter, args.target)
        print_out(dump_json(data) if args.json else "\n".join(show_lines(data)))
        return PROBLEM if data["problems"] else OK
    from .layers import series_reader

    series_reader()
    if args.cmd == "check":
        from .fit import check

        rep = check(args.drafter, args.target, args.trust_remote_code)
        print_out(dump_json({"header": rep.header, "checks": rep.records[:-1],
                         "problems": rep.problems, "fits": not rep.problems})
              if args.json else "\n".join(rep.lines))
        return PROBLEM if rep.problems else OK
    from .fit import calibrate

    engine_args = {"tensor_parallel_size": args.tensor_parallel_size,
                   "trust_remote_code": args.trust_remote_code}
    if args.enforce_eager:
        engine_args["enforce_eager"] = True
    result = calibrate(args.drafter, args.target, prompts=args.prompts,
                       max_tokens=args.max_tokens, write=args.write, via=args.via,
                       engine_args=engine_args, candidates=args.candidates)
    print_out(dump_json({k: v for k, v in result.items() if k != "lines"}) if args.json
          else "\n".join(result["lines"]))
    return PROBLEM if result["verdict"] == "undetermined" else OK


def run(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The console script: an error is one line on stderr (or, with --json,
    {"error": ...} on stdout), exit status 2; never a traceback, unless -v
    asks for one of an error that is not the input's."""
    drop_source_trees_from_path()
    args = list(sys.argv[1:] if argv is None else argv)
    as_json, verbose = "--json" in args, "-v" in args or "--verbose" in args

    def fail(line: str) -> int:
        if as_json:
            print_out(dump_json({"error": line, "exit_status": CANNOT}))
        else:
            with contextlib.suppress(OSError):
                print(line, file=sys.stderr, flush=True)
        return CANNOT

    try:
        return main(args, prog)
    except UsageError as e:
        return fail(str(e))
    except ToolError as e:
        return fail(f"{prog}: error: {e}")
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        print_out("")  # the reader left: quiet, as print_out is
        return CANNOT
    except Exception as e:  # noqa: BLE001 - a bug, not the input: one line, -v shows it
        if verbose:
            import traceback

            traceback.print_exc()
        text = " ".join(str(e).split())[:300]
        return fail(f"{prog}: error: unexpected {type(e).__name__}: {text} (vllm-eagle3 "
                    "has no check for this input yet: rerun with -v for the traceback and "
                    "report it)")


def console() -> None:
    sys.exit(run())
