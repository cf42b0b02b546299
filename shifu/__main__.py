from shifu.cli import main

raise SystemExit(main())
