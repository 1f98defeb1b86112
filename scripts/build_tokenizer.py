"""Build a byte-level BPE tokenizer.json from local text (.txt / .jsonl), for [data] tokenizer.

    python scripts/build_tokenizer.py DATA_PATH OUT.json [--vocab-size 8192]

A bad argument or data file is refused in one line (exit status 2) and nothing is written: the tokenizer
is trained into a temporary file that replaces OUT.json only once it is complete.
"""

import argparse
import os
import sys
import tempfile

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.components.data.text import iter_documents, list_files
from torchtitan_moe.components.data.tokenizer import train_bpe

MIN_VOCAB = 257  # the 256 bytes of the byte-level alphabet and <|endoftext|>


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"build_tokenizer: error: {message} (--help lists the arguments)", file=sys.stderr)
        sys.exit(2)


def check_arguments(args) -> None:
    if args.vocab_size < MIN_VOCAB:
        raise ConfigError(f"--vocab-size {args.vocab_size}: must be >= {MIN_VOCAB} (the 256 bytes and <|endoftext|>)")
    if not os.path.exists(args.data_path):
        raise ConfigError(f"{args.data_path}: no such file or folder (the text to learn from)")
    if os.path.isdir(args.out):
        raise ConfigError(f"{args.out} is a folder: OUT is the tokenizer.json file to write")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise ConfigError(f"{args.out}: its folder {parent} does not exist")


def build(args) -> int:
    check_arguments(args)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    with tempfile.TemporaryDirectory() as tmp:
        # The trainer reads plain text files: flatten JSONL records into one.
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            for doc in iter_documents(list_files(args.data_path)):
                f.write(doc + "\n")
        fd, partial = tempfile.mkstemp(suffix=".json.partial", dir=out_dir)
        os.close(fd)
        try:
            tokenizer = train_bpe([corpus], args.vocab_size, partial)
            os.replace(partial, args.out)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return tokenizer.get_vocab_size()


def main(argv=None) -> int:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_path", help="a .txt/.jsonl file or a folder of them")
    parser.add_argument("out", help="where to write tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    try:
        tokens = build(args)
    except (ConfigError, OSError) as e:
        print(f"build_tokenizer: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
