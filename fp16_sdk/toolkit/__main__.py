"""`python -m fp16_sdk.toolkit`: the same as the `train` console script."""

from fp16_sdk.toolkit.cli import main

if __name__ == "__main__":
    main()
