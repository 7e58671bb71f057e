"""`orchestrator train | tune | ui | doctor | prepare | show-config | cluster`: each subcommand is a
few lines around one API call."""

from __future__ import annotations

import argparse
import os
import sys

from orchestrator.config import Config, load_config, reference, to_yaml
from orchestrator.errors import UserError
from pipelines.errors import DataError


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="experiment YAML (default: the "
                                               "built-in digits experiment)")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config key, e.g. --set optim.lr=1e-3 (repeatable; the "
                             "value is YAML; model.KEY=null drops a model option the file sets)")


class _Version(argparse.Action):
    """`--version`: the installed package's version, looked up only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the orchestrator version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("orchestrator")
        except PackageNotFoundError:
            found = "unknown (not installed)"
        print(f"{parser.prog} {found}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator",
                                     description="Distributed PyTorch training on Ray.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_tune_parser(sub)
    _add_doctor_parser(sub)
    _add_ui_parser(sub)
    _add_show_config_parser(sub)
    _add_prepare_parser(sub)
    _add_cluster_parser(sub)
    return parser


# Where `train --help` and `tune --help` send a reader who wants every key;
# RawDescriptionHelpFormatter keeps it on one line, as written (the options' help is wrapped as
# before).
CONFIG_EPILOG = ("Every configuration key with its meaning: orchestrator show-config --explain "
                 "(or docs/config.md)")


def _add_train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = sub.add_parser("train", help="train a model on a local or existing "
                                         "Ray cluster", epilog=CONFIG_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_args(train)
    train.add_argument("--address", help="join this Ray cluster (default: "
                                         "$RAY_ADDRESS, else start a local one)")
    train.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN",
                       help="continue a run from its latest checkpoint, in the same MLflow "
                            "run: the newest run of this experiment in storage.path trained "
                            "with this config (a new run if the experiment has none), or "
                            "RUN: a run's name, or its directory's path or s3:// URI")
    train.add_argument("--verbose", "-v", action="store_true",
                       help="also show Ray's and MLflow's own log lines "
                            "(always written to the run's log file)")
    train.add_argument("--autopilot", action="store_true",
                       help="measure the speed settings that leave the math unchanged "
                            "(micro-batch split, compile, torch threads, flush_denormal, "
                            "precision when auto) on the run's first steps, then train "
                            "with the fastest (autopilot.enabled=true; docs/autopilot.md)")


def _add_tune_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tune = sub.add_parser("tune", help="search hyperparameters (tune section): "
                                       "every trial a distributed run",
                          epilog=CONFIG_EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_args(tune)
    tune.add_argument("--address", help="join this Ray cluster (default: "
                                        "$RAY_ADDRESS, else start a local one)")
    tune.add_argument("--fresh", action="store_true",
                      help="delete the study's saved state and start it "
                           "over (default: continue an interrupted study)")
    tune.add_argument("--verbose", "-v", action="store_true",
                      help="also show Ray's, Tune's and MLflow's own log "
                           "lines (always written to the study's log file)")


def _add_doctor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser("doctor", help="diagnose a finished or running run from its "
                                           "MLflow record and print the config changes to try")
    doctor.add_argument("run_id", metavar="RUN_ID",
                        help="MLflow run id (printed at the end of train and tune)")
    doctor.add_argument("--tracking-uri", help="MLflow tracking URI (default: "
                                               "$MLFLOW_TRACKING_URI, else "
                                               "sqlite:///mlruns.db in the working directory)")


def _add_ui_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ui = sub.add_parser("ui", help="start the MLflow UI on the runs' store (this "
                                   "environment's MLflow, a free port) and print "
                                   "the experiment's URL; Ctrl+C stops it")
    _config_args(ui)
    ui.add_argument("--tracking-uri", help="MLflow store (default: the config's tracking.uri, else "
                    "$MLFLOW_TRACKING_URI, else sqlite:///mlruns.db in the working directory)")
    ui.add_argument("--experiment", help="MLflow experiment to open (default: "
                                         "the config's tracking.experiment)")
    ui.add_argument("--port", type=int, help="port on 127.0.0.1 (default: 5055, "
                                             "or a free one when it is taken)")


def _add_show_config_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    show = sub.add_parser("show-config", help="print the resolved config as YAML")
    _config_args(show)
    show.add_argument("--explain", action="store_true",
                      help="write each key's meaning above it as a # comment")
    show.add_argument("--plan", action="store_true",
                      help="check the config against the data, the model, the price "
                           "table and storage, as `train` does before Ray starts, "
                           "and print the run's plan (what MLflow keeps as plan.yaml)")
    show.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN",
                      help="with --plan: plan the resume of a run, as `train --resume [RUN]` would")


def _add_cluster_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser("cluster", help="the warm local Ray cluster a command leaves "
                                             "running with cluster.keep_warm_minutes > 0, "
                                             "for the next command to join")
    actions = cluster.add_subparsers(dest="action", required=True)
    actions.add_parser("status", help="show it: its address, what it "
                                      "serves, how long it has been idle")
    actions.add_parser("stop", help="stop it now (every process of it, by PID)")


# Help texts the `prepare` datasets share.
_OUT_HELP = "directory (or s3://bucket/prefix) to write the train/ and val/ splits into"
_SEED_HELP = "random seed of the train/val split (default: %(default)s)"
_SHARDS_HELP = ("Parquet files per training split; validation gets half as many "
                "(default: %(default)s)")


def _add_prepare_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prepare = sub.add_parser("prepare", help="write a dataset as Parquet shards")
    kinds = prepare.add_subparsers(dest="dataset", required=True)
    _add_digits_parser(kinds)
    _add_synthetic_parser(kinds)
    _add_text_parser(kinds)
    _add_diabetes_parser(kinds)
    _add_sequences_parser(kinds)


def _add_digits_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    digits = kinds.add_parser("digits", help="scikit-learn's bundled 8x8 digit "
                                             "images (real data, no download)")
    digits.add_argument("--out", required=True, help=_OUT_HELP)
    digits.add_argument("--shards", type=int, default=4, help=_SHARDS_HELP)
    digits.add_argument("--seed", type=int, default=0, help=_SEED_HELP)


def _add_synthetic_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    synthetic = kinds.add_parser("synthetic",
                                 help="a learnable synthetic classification set of any size")
    synthetic.add_argument("--out", required=True, help=_OUT_HELP)
    synthetic.add_argument("--rows", type=int, required=True, help="training rows to generate")
    synthetic.add_argument("--shards", type=int, default=8,
                           help="Parquet files of the training split (default: %(default)s)")
    synthetic.add_argument("--features", type=int, default=64,
                           help="float features per row, in one "
                                "'features' column (default: %(default)s)")
    synthetic.add_argument("--classes", type=int, default=10,
                           help="classes of the 'label' column (default: %(default)s)")
    synthetic.add_argument("--val-rows", type=int, default=0,
                           help="validation rows, one file; 0 writes "
                                "no val/ split (default: %(default)s)")
    synthetic.add_argument("--seed", type=int, default=0,
                           help="random seed of the class centres "
                                "and the rows (default: %(default)s)")


def _add_text_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = kinds.add_parser("text", help="byte-tokenised local text files "
                                         "as fixed-length token sequences")
    text.add_argument("--input", nargs="+", required=True, metavar="FILE",
                      help="local text files, read as bytes and joined")
    text.add_argument("--out", required=True, help=_OUT_HELP)
    text.add_argument("--seq-len", type=int, default=128,
                      help="tokens per training sequence; each row holds seq-len "
                           "+ 1 for the shifted targets (default: %(default)s)")
    text.add_argument("--shards", type=int, default=4,
                      help="Parquet files of the training split; "
                           "validation is one file (default: %(default)s)")
    text.add_argument("--val-fraction", type=float, default=0.1,
                      help="the last fraction of the sequences, kept "
                           "for validation (default: %(default)s)")


def _add_diabetes_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    diabetes = kinds.add_parser("diabetes", help="scikit-learn's bundled diabetes regression "
                                                 "set (real data, no download): features, "
                                                 "category ids and a standardised target")
    diabetes.add_argument("--out", required=True, help=_OUT_HELP)
    diabetes.add_argument("--shards", type=int, default=2, help=_SHARDS_HELP)
    diabetes.add_argument("--val-fraction", type=float, default=0.2,
                          help="fraction of the rows kept for validation, "
                               "between 0 and 1 (default: %(default)s)")
    diabetes.add_argument("--seed", type=int, default=0, help=_SEED_HELP)


def _add_sequences_parser(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sequences = kinds.add_parser("sequences",
                                 help="a learnable synthetic classification "
                                      "set of variable-length token lists")
    sequences.add_argument("--out", required=True, help=_OUT_HELP)
    sequences.add_argument("--rows", type=int, default=2000,
                           help="rows to generate, train and validation "
                                "together (default: %(default)s)")
    sequences.add_argument("--vocab", type=int, default=64,
                           help="token ids 0..vocab-1, at least 4: 0 pads, "
                                "1 starts each row (default: %(default)s)")
    sequences.add_argument("--min-len", type=int, default=4,
                           help="fewest tokens in a row, its start token "
                                "included; at least 2 (default: %(default)s)")
    sequences.add_argument("--max-len", type=int, default=24,
                           help="most tokens in a row (default: %(default)s)")
    sequences.add_argument("--shards", type=int, default=2, help=_SHARDS_HELP)
    sequences.add_argument("--val-fraction", type=float, default=0.2,
                           help="fraction of the rows kept for validation, "
                                "between 0 and 1 (default: %(default)s)")
    sequences.add_argument("--seed", type=int, default=0,
                           help="random seed of the rows (default: %(default)s)")


def run_command(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "cluster":
        from orchestrator.cluster.warm import status, stop_now

        print(stop_now() if args.action == "stop" else status())
        return 0
    # `--autopilot` is `--set autopilot.enabled=true`, last: it wins over the file and the other
    # overrides.
    overrides = [*args.overrides,
                 *(["autopilot.enabled=true"] if getattr(args, "autopilot", False) else [])]
    config = load_config(args.config, overrides)
    if args.command == "show-config":
        return _show_config(args, config)
    if args.command == "ui":
        return _ui(args, config)
    if args.command == "tune":
        return _tune(args, config)
    return _train(args, config)


def _doctor(args: argparse.Namespace) -> int:
    from orchestrator.doctor.report import doctor
    from orchestrator.doctor.report import summary as doctor_summary

    print(doctor_summary(args.run_id, doctor(args.run_id, args.tracking_uri)))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from pipelines.prepare import (
        prepare_diabetes,
        prepare_digits,
        prepare_sequences,
        prepare_synthetic,
        prepare_text,
    )

    if args.dataset == "digits":
        counts = prepare_digits(args.out, shards=args.shards, seed=args.seed)
    elif args.dataset == "diabetes":
        counts = prepare_diabetes(args.out, shards=args.shards, val_fraction=args.val_fraction,
                                  seed=args.seed)
    elif args.dataset == "sequences":
        counts = prepare_sequences(args.out, rows=args.rows, vocab=args.vocab,
                                   lengths=(args.min_len, args.max_len), shards=args.shards,
                                   val_fraction=args.val_fraction, seed=args.seed)
    elif args.dataset == "text":
        counts = prepare_text(args.input, args.out, seq_len=args.seq_len, shards=args.shards,
                              val_fraction=args.val_fraction)
    else:
        counts = prepare_synthetic(args.out, rows=args.rows, shards=args.shards,
                                   features=args.features, classes=args.classes,
                                   val_rows=args.val_rows, seed=args.seed)
    print(f"wrote {', '.join(f'{n} {split} rows' for split, n in counts.items())} to {args.out}")
    return 0


def _show_config(args: argparse.Namespace, config: Config) -> int:
    from orchestrator.run.model_checks import check_model_options
    from orchestrator.run.plan import plan_run

    if args.plan:  # the config resolved for the data, and what the run would be
        plan = plan_run(config, resume=args.resume, verbose=False)
        print(reference.explain(plan.config) if args.explain else to_yaml(plan.config), end="")
        print("---\n# The run's plan: what `train` decided before Ray starts.\n" + plan.to_yaml(),
              end="")
        return 0
    check_model_options(config.model)  # what train and tune check before they take any resource
    print(reference.explain(config) if args.explain else to_yaml(config), end="")
    return 0


def _ui(args: argparse.Namespace, config: Config) -> int:
    from pathlib import Path

    from orchestrator.report.ui import serve
    from pipelines.storage import user_cache_dir

    log = Path(user_cache_dir()) / "logs" / "mlflow-ui.log"
    return serve(args.tracking_uri or config.tracking.uri,
                 args.experiment or config.tracking.experiment, args.port, log)


def _tune(args: argparse.Namespace, config: Config) -> int:
    from orchestrator.report.startup import process_started_at
    from orchestrator.tuning.results import summary as tune_summary
    from orchestrator.tuning.study import tune

    print(tune_summary(tune(config, address=args.address, fresh=args.fresh, show_logs=args.verbose,
                            started_at=process_started_at())))
    return 0


def _train(args: argparse.Namespace, config: Config) -> int:
    from orchestrator.report.startup import process_started_at
    from orchestrator.run.launch import train
    from orchestrator.run.result import summary

    # The clock starts with this process, as a stopwatch around the command would.
    print(summary(train(config, address=args.address, resume=args.resume,
                        started_at=process_started_at(), show_logs=args.verbose)))
    return 0


def main(argv: list[str] | None = None) -> int:
    # Like `python -m`: modules in the working directory (e.g. a model entrypoint) are importable.
    sys.path.insert(0, os.getcwd())
    args = build_parser().parse_args(argv)
    try:
        return run_command(args)
    except (UserError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command not in ("train", "ui"):  # train says where it stopped and how to continue
            print("interrupted", file=sys.stderr)
        if args.command == "ui":  # Ctrl+C is how the UI is stopped
            return 0
        return 130


def entry() -> None:
    """The `orchestrator` command: `main`, then exit without tearing the interpreter down module by
    module. Ray and MLflow are shut down and every file is closed by then; the teardown itself
    (torch, pyarrow and Ray's C++ objects) took 1.4 s after the summary was printed, time the user
    would wait for nothing."""
    import atexit

    code = main()
    # what an ordinary exit runs: handlers registered by libraries and by user code
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
