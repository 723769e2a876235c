"""``python -m lightning_gpuopt`` is the ``gpuopt`` command."""

from lightning_gpuopt.cli.main import main

if __name__ == "__main__":
    main()
