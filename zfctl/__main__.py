"""`python -m zfctl ...` == `zfctl ...` (also what torchrun relaunches with `-m zfctl`)."""

from zfctl.cli import main

if __name__ == "__main__":
    main()
