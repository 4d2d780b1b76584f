"""``python -m perturbkit.demo``: see :mod:`perturbkit.demo`."""
from perturbkit.demo._run import main

if __name__ == '__main__':
  main()
