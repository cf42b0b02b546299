from shifu.cli.main import main

raise SystemExit(main())
