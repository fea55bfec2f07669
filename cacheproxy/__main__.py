import sys

from cacheproxy.cli.main import main

sys.exit(main())
