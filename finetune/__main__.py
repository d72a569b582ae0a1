"""`python -m finetune` runs the same CLI as the `finetune` command."""

from finetune.cli import main

main()
