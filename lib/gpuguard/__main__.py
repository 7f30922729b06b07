from gpuguard.cli import main

raise SystemExit(main())
