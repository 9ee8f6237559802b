from k3serve.cli import main

raise SystemExit(main())
