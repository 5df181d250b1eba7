from tierserve.cli.main import main

raise SystemExit(main())
