"""Build a byte-level BPE tokenizer.json from local text (.txt / .jsonl), for [data] tokenizer.

    python scripts/build_tokenizer.py DATA_PATH OUT.json [--vocab-size 8192]
"""

import argparse
import os
import tempfile

from torchtitan_moe.components.data.text import list_files, read_documents
from torchtitan_moe.components.data.tokenizer import train_bpe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_path", help="a .txt/.jsonl file or a folder of them")
    parser.add_argument("out", help="where to write tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # The trainer reads plain text files: flatten JSONL records into one.
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            for doc in read_documents(list_files(args.data_path)):
                f.write(doc + "\n")
        tokenizer = train_bpe([corpus], args.vocab_size, args.out)
    print(f"wrote {args.out}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
