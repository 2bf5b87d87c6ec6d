from hutch.cli.main import main

main()
