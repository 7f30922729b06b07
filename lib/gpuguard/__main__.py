from gpuguard.cli.main import main

raise SystemExit(main())
