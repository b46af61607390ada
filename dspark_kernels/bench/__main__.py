"""``python -m dspark_kernels.bench <name> [options]``."""

import argparse

from ..cli_args import check_corpus, missing_inputs_are_usage_errors
from . import acceptance, ceiling, peers, serving


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark_kernels.bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True)
    acceptance_parser = sub.add_parser("acceptance", help=acceptance.__doc__.split("\n")[0])
    acceptance.add_arguments(acceptance_parser)
    serving_parser = sub.add_parser("serving", help=serving.__doc__.split("\n")[0])
    serving.add_arguments(serving_parser)
    peers.add_arguments(sub.add_parser("peers", help=peers.__doc__.split("\n")[0]))
    ceiling_parser = sub.add_parser("ceiling", help=ceiling.__doc__.split("\n")[0])
    ceiling.add_arguments(ceiling_parser)
    args = parser.parse_args()
    if args.name == "acceptance":
        acceptance.check_arguments(acceptance_parser, args)
    elif args.name == "serving":
        serving.check_arguments(serving_parser, args)
    elif args.name == "ceiling":
        args.build_corpus = check_corpus(ceiling_parser, args.corpus)
    mains = {"acceptance": acceptance.main, "serving": serving.main, "peers": peers.main, "ceiling": ceiling.main}
    with missing_inputs_are_usage_errors(parser):
        mains[args.name](args)


if __name__ == "__main__":
    main()
